"""End to end with an agent framework that speaks OpenAI tools: the OpenAI Agents SDK
(``openai-agents``) drives the daemon, offline (tracing off), with a function tool. The
first turn must call the tool (``tool_choice: required``); the SDK runs it with the
arguments the server returned and sends the result back; the next turn (the SDK resets
the choice to ``auto``) is the final answer. The city is bounded to 12 characters so that
a story model's call ends well within max_tokens."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

import pytest

from localserve.server.config import ServerConfig

from .server_util import running_server, small_engine_config, stories_with_template
from .test_tool_calls import HERMES_STYLE

agents = pytest.importorskip("agents")


def test_an_agent_calls_our_tool_and_answers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)], unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather in a city."""
        calls.append((city, unit))
        return f"21 degrees {unit} in {city}"

    path = stories_with_template(tmp_path, HERMES_STYLE)
    config = ServerConfig(models={"stories": path}, preload=["stories"], engine=small_engine_config(), device="cpu")
    with running_server(config) as server:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        agent = agents.Agent(
            name="weather", instructions="Answer briefly.", tools=[get_weather],
            model=agents.OpenAIChatCompletionsModel(model="stories", openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=100,
                                                temperature=0.8, seed=1))
        result = agents.Runner.run_sync(agent, "What's the weather in Paris?", max_turns=3)
    assert len(calls) == 1 and calls[0][1] in ("celsius", "fahrenheit")
    tool_outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert tool_outputs and tool_outputs[0].output == f"21 degrees {calls[0][1]} in {calls[0][0]}"
    assert isinstance(result.final_output, str) and result.final_output
