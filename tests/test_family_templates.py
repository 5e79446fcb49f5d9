"""The chat templates of the families beyond Llama (Gemma 3, Phi-4, GPT-OSS's harmony format,
Granite 3, OLMoE's Tulu format) render as transformers renders them. The templates in
tests/chat_templates/ are written for the tests after each family's documented structure
(Gemma 2's and Phi-3.5's real templates are checked in test_chat_template.py); they use what
the real ones do: macros, namespaces, ``strftime_now``, ``raise_exception``, ``tojson`` with an
indent, typed content parts, tools, thinking and tool calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from localserve.errors import LocalserveError
from localserve.text.chat_template import ChatTemplate

from .test_chat_template import CHAT, SYSTEM, TOOL_CHAT, WEATHER_TOOL

TEMPLATES = Path(__file__).parent / "chat_templates"
# Each family's own special tokens.
TOKENS = {
    "gemma3": {"bos_token": "<bos>", "eos_token": "<eos>"},
    "phi4": {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"},
    "gpt_oss": {"bos_token": "<|startoftext|>", "eos_token": "<|return|>"},
    "granite3": {"bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>"},
    "olmoe": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
}
THINKING_CHAT = [
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Hello.", "thinking": "An earlier turn's thought, dropped."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "thinking": "I should call the tool.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
]
PARTS_CHAT = [
    {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
    {"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "image"}, {"type": "text", "text": " it."}]},
]
# (family, conversation, extra variables) for every case compared with transformers.
CASES: list[tuple[str, list[dict[str, Any]], dict[str, Any]]] = [
    *((family, [SYSTEM, *CHAT], {}) for family in TOKENS),
    *((family, CHAT, {}) for family in TOKENS),
    ("gemma3", PARTS_CHAT, {}),
    ("gpt_oss", THINKING_CHAT, {"tools": [WEATHER_TOOL], "reasoning_effort": "high"}),
    ("gpt_oss", TOOL_CHAT, {"tools": [WEATHER_TOOL]}),
    ("granite3", TOOL_CHAT[1:], {"tools": [WEATHER_TOOL]}),
]


def source(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")


def render(family: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    return ChatTemplate(source(family), **TOKENS[family]).render(messages, **variables)


@pytest.fixture(scope="module")
def hf_render():
    utils = pytest.importorskip("transformers.utils.chat_template_utils")

    def run(family: str, messages: list[dict[str, Any]], **variables: Any) -> str:
        rendered, _ = utils.render_jinja_template(conversations=[messages], chat_template=source(family),
                                                  **variables, **TOKENS[family])
        return rendered[0]

    return run


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: f"{CASES[i][0]}-{i}")
def test_renders_as_transformers(hf_render, case: int, add_generation_prompt: bool) -> None:
    family, messages, variables = CASES[case]
    got = render(family, messages, add_generation_prompt=add_generation_prompt, **variables)
    assert got == hf_render(family, messages, add_generation_prompt=add_generation_prompt, **variables)


def test_each_family_shapes_the_prompt_its_way() -> None:
    gemma = render("gemma3", [SYSTEM, *CHAT])
    assert gemma.startswith("<bos><start_of_turn>user\nYou are terse.\n\nHi there!<end_of_turn>\n<start_of_turn>model\n")
    assert render("gemma3", PARTS_CHAT).endswith("Describe<start_of_image>it.<end_of_turn>\n<start_of_turn>model\n")
    assert render("phi4", CHAT).endswith("<|im_start|>assistant<|im_sep|>")
    harmony = render("gpt_oss", THINKING_CHAT, tools=[WEATHER_TOOL], reasoning_effort="high")
    assert "Reasoning: high" in harmony and "type get_weather = (_: {\n// The city, e.g. Zürich\ncity: string," in harmony
    assert 'unit?: "celsius" | "fahrenheit",' in harmony and "days?: number[]," in harmony
    assert "earlier turn" not in harmony and "<|channel|>analysis<|message|>I should call the tool.<|end|>" in harmony
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"21 C"<|end|>') in harmony
    assert "Reasoning: medium" in render("gpt_oss", CHAT)
    granite = render("granite3", TOOL_CHAT[1:], tools=[WEATHER_TOOL])
    assert "Today's Date: " in granite and '<|start_of_role|>available_tools<|end_of_role|>[\n    {' in granite
    assert '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]' in granite
    assert render("olmoe", CHAT).startswith("<|endoftext|><|user|>\nHi there!\n<|assistant|>\nHello.")


def test_their_refusals_are_clean_errors() -> None:
    with pytest.raises(LocalserveError, match="roles must alternate"):
        render("gemma3", [CHAT[0], CHAT[0]])
    with pytest.raises(LocalserveError, match="must follow a tool call"):
        render("gpt_oss", [CHAT[0], TOOL_CHAT[3]])
