"""Anthropic's Messages API through the official anthropic SDK, against stories260K served
with a Hermes-style tool template (and a thinking one): each answer is checked against
what the OpenAI endpoint gives for the same conversation (same greedy tokens, same tool
calls, same prompt), streamed answers against whole ones, the raw event order against
Anthropic's, errors against Anthropic's shape; and the pieces without a server: the
request made into the OpenAI chat request, a cut-short call's input read as the SDK reads it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import anthropic
import httpx
import jsonschema
import openai
import pytest
from jiter import from_json

from localserve.server.anthropic_api import object_so_far
from localserve.server.anthropic_protocol import MessagesRequest
from localserve.server.config import ServerConfig

from .server_util import RunningServer, running_server, small_engine_config, stories_with_template
from .test_reasoning import STEER, THINKING_TEMPLATE
from .test_tool_calls import HERMES_STYLE, SCHEMAS, TOOLS

GREEDY = {"temperature": 0}  # the SDK no longer names sampling fields; the API still takes them
USER = [{"role": "user", "content": "What's the weather in Paris?"}]
# The tools as Anthropic's clients give them
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
WEATHER_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>'


@contextmanager
def serve(root, template: str, **config_fields: object) -> Iterator[RunningServer]:  # type: ignore[no-untyped-def]
    config = ServerConfig(models={"stories": stories_with_template(root, template)}, preload=["stories"],
                          engine=small_engine_config(), device="cpu", **config_fields)  # type: ignore[arg-type]
    with running_server(config) as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with serve(tmp_path_factory.mktemp("models"), HERMES_STYLE) as server:
        yield server


@pytest.fixture(scope="module")
def claude(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oai(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def streamed(claude: anthropic.Anthropic, **request: object) -> anthropic.types.Message:
    with claude.messages.stream(**request) as stream:  # type: ignore[arg-type]
        for _ in stream:
            pass
        return stream.get_final_message()


def same_message(whole: anthropic.types.Message, streamed: anthropic.types.Message) -> None:
    """Equal but for their ids (a stream's message is the SDK's own ParsedMessage)."""
    def plain(message: anthropic.types.Message) -> dict:
        data = message.model_dump(exclude={"id"}, exclude_none=True)
        for block in data["content"]:
            block.pop("parsed_output", None)
            if block["type"] == "tool_use":
                assert block.pop("id").startswith("toolu_")
        return data

    assert plain(whole) == plain(streamed)


def events(server: RunningServer, body: dict) -> list[tuple[str, dict]]:
    """The raw stream: (event name, data) of each server-sent event."""
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        text = "".join(response.iter_text())
    found = []
    for event in text.strip().split("\n\n"):
        name, data = event.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        found.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return found


def draft_tokens_verified(server: RunningServer) -> float:
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("localserve_spec_decode_num_draft_tokens_total"))


# -- plain messages --------------------------------------------------------------------------------

def test_a_message_is_the_chat_completions_reply(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    message = claude.messages.create(model="stories", max_tokens=24, messages=USER, extra_body=GREEDY)
    chat = oai.chat.completions.create(model="stories", max_tokens=24, messages=USER, temperature=0)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == "stories"
    [block] = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content and block.text.strip()
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    assert chat.choices[0].finish_reason == "length"
    assert (message.usage.input_tokens, message.usage.output_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (chat.usage.prompt_tokens, 24)


def test_system_and_turns_render_as_chat_messages(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    """A system prompt (a string, or text blocks) and several turns, content as a string or
    as text blocks, give the tokens the same OpenAI conversation gives."""
    turns = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a time"},
             {"role": "user", "content": [{"type": "text", "text": "Go on,"}, {"type": "text", "text": "please."}]}]
    as_openai = [{"role": "system", "content": "You tell stories."}, *turns[:2],
                 {"role": "user", "content": "Go on,\nplease."}]  # text blocks a line apart
    chat = oai.chat.completions.create(model="stories", max_tokens=16, messages=as_openai, temperature=0)
    for system in ("You tell stories.", [{"type": "text", "text": "You tell stories.", "cache_control": {
            "type": "ephemeral"}}]):
        message = claude.messages.create(model="stories", max_tokens=16, system=system, messages=turns,
                                         metadata={"user_id": "u1"}, extra_body=GREEDY)
        assert message.content[0].text == chat.choices[0].message.content
        assert message.usage.input_tokens == chat.usage.prompt_tokens


def test_a_final_assistant_turn_is_continued(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    """A prefill: the reply goes on from the final assistant turn, as Anthropic's does and
    as continue_final_message does."""
    prefill = [*USER, {"role": "assistant", "content": "It is sunny and"}]
    message = claude.messages.create(model="stories", max_tokens=12, messages=prefill, extra_body=GREEDY)
    chat = oai.chat.completions.create(model="stories", max_tokens=12, messages=prefill, temperature=0,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert message.content[0].text == chat.choices[0].message.content
    assert message.usage.input_tokens == chat.usage.prompt_tokens


def test_stop_sequences_name_the_one_that_stopped(claude: anthropic.Anthropic) -> None:
    ask = dict(model="stories", messages=USER, extra_body=GREEDY)
    full = claude.messages.create(max_tokens=40, **ask).content[0].text  # type: ignore[arg-type]
    words = full.split()
    first, later = words[2], words[-2]
    assert full.index(first) < full.index(later)
    # Listed later, begins first: it is the one that stops the reply
    request = dict(max_tokens=40, stop_sequences=[later, "zzz", first], **ask)
    message = claude.messages.create(**request)  # type: ignore[arg-type]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", first)
    assert message.content[0].text == full[:full.index(first)]
    same_message(message, streamed(claude, **request))
    unstopped = claude.messages.create(max_tokens=40, stop_sequences=["zzz"], **ask)  # type: ignore[arg-type]
    assert (unstopped.stop_reason, unstopped.stop_sequence, unstopped.content[0].text) == ("max_tokens", None, full)


def test_more_than_the_context_holds(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    """max_tokens beyond what the context leaves (a 400 on the OpenAI routes): the reply stops
    when the context is full, as Anthropic's newer models answer; a prompt that fills the
    context alone is still a 400."""
    ask = dict(model="stories", max_tokens=16_000, messages=USER, extra_body=GREEDY)
    message = claude.messages.create(**ask)  # type: ignore[arg-type]
    assert message.stop_reason == "model_context_window_exceeded"
    assert message.usage.input_tokens + message.usage.output_tokens == 512  # stories260K's context
    same_message(message, streamed(claude, **ask))
    with pytest.raises(openai.BadRequestError, match="512"):
        oai.chat.completions.create(model="stories", max_tokens=16_000, messages=USER)
    with pytest.raises(anthropic.BadRequestError, match="512"):
        claude.messages.create(model="stories", max_tokens=4, messages=[{"role": "user", "content": "Hi " * 600}])


def test_a_finished_reply_ends_its_turn(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model="stories", max_tokens=20, messages=USER,
                                     extra_body={**GREEDY, "guided_regex": "Yes, it is sunny\\."})
    assert (message.stop_reason, message.content[0].text) == ("end_turn", "Yes, it is sunny.")
    assert message.usage.output_tokens < 20


def test_streamed_equals_whole(claude: anthropic.Anthropic, server: RunningServer) -> None:
    for request in (dict(max_tokens=30), dict(max_tokens=30, extra_body={"temperature": 1.0, "seed": 7}),
                    dict(max_tokens=120, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"})):
        ask = {"model": "stories", "messages": USER, "extra_body": GREEDY, **request}
        same_message(claude.messages.create(**ask), streamed(claude, **ask))  # type: ignore[arg-type]


def test_the_raw_stream_is_anthropics(claude: anthropic.Anthropic, server: RunningServer) -> None:
    """message_start, each block's start, deltas and stop in turn, message_delta, message_stop;
    each event named by its type."""
    body = {"model": "stories", "max_tokens": 120, "messages": USER, "tools": ANTHROPIC_TOOLS, **GREEDY,
            "guided_regex": f"Checking\\.\\n{WEATHER_CALL}"}
    found = events(server, body)
    assert all(name == data["type"] for name, data in found)
    names = [name for name, _ in found]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    start = found[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    blocks, open_index = [], None
    for name, data in found[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            open_index = data["index"]
            blocks.append(data["content_block"]["type"])
        else:
            assert data["index"] == open_index and name in ("content_block_delta", "content_block_stop")
            if name == "content_block_stop":
                open_index = None
    assert open_index is None and blocks == ["text", "tool_use"]
    deltas = [data["delta"] for name, data in found if name == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"text_delta", "input_json_delta"}
    assert sum(d["type"] == "input_json_delta" for d in deltas) > 3  # the arguments as they were generated
    end = found[-2][1]
    whole = claude.messages.create(model="stories", max_tokens=120, messages=USER, tools=ANTHROPIC_TOOLS,
                                   extra_body={**GREEDY, "guided_regex": body["guided_regex"]})
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == whole.usage.output_tokens
    assert "".join(d.get("text", "") for d in deltas) == whole.content[0].text == "Checking.\n"
    assert json.loads("".join(d.get("partial_json", "") for d in deltas)) == whole.content[1].input


def test_count_tokens_is_the_prompt(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    turns = [*USER, {"role": "assistant", "content": "Let me see."}, {"role": "user", "content": "Thanks!"}]
    counted = claude.messages.count_tokens(model="stories", system="Be brief.", messages=turns,
                                           tools=ANTHROPIC_TOOLS)  # type: ignore[arg-type]
    chat = oai.chat.completions.create(model="stories", max_tokens=1, temperature=0, tools=TOOLS,
                                       messages=[{"role": "system", "content": "Be brief."}, *turns])
    message = claude.messages.create(model="stories", max_tokens=1, system="Be brief.", messages=turns,
                                     tools=ANTHROPIC_TOOLS, extra_body=GREEDY)  # type: ignore[arg-type]
    assert counted.input_tokens == chat.usage.prompt_tokens == message.usage.input_tokens
    without_tools = claude.messages.count_tokens(model="stories", system="Be brief.", messages=turns)
    assert 0 < without_tools.input_tokens < counted.input_tokens  # the template lists the tools


# -- tools -----------------------------------------------------------------------------------------

def tool_uses(message: anthropic.types.Message, names: set[str]) -> list[tuple[str, dict]]:
    found = []
    for block in message.content:
        if block.type == "tool_use":
            assert block.id.startswith("toolu_") and block.name in names
            jsonschema.validate(block.input, SCHEMAS[block.name])
            found.append((block.name, block.input))
    return found


@pytest.mark.parametrize("choice, openai_choice", [
    ({"type": "any", "disable_parallel_tool_use": True}, "required"),
    ({"type": "tool", "name": "get_time"}, {"type": "function", "function": {"name": "get_time"}}),
], ids=["any", "tool"])
def test_forced_tool_use_is_the_chat_completions_call(claude: anthropic.Anthropic, oai: openai.OpenAI, choice,
                                                      openai_choice) -> None:  # type: ignore[no-untyped-def]
    names = {"get_weather", "get_time"} if choice["type"] == "any" else {"get_time"}
    for seed in range(3):
        ask = dict(model="stories", max_tokens=120, messages=USER, tools=ANTHROPIC_TOOLS, tool_choice=choice,
                   extra_body={"temperature": 1.0, "seed": seed})
        message = claude.messages.create(**ask)  # type: ignore[arg-type]
        assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["tool_use"]
        calls = tool_uses(message, names)
        chat = oai.chat.completions.create(model="stories", max_tokens=120, messages=USER, tools=TOOLS,
                                           tool_choice=openai_choice, parallel_tool_calls=False, temperature=1.0,
                                           seed=seed)
        assert calls == [(c.function.name, json.loads(c.function.arguments))
                         for c in chat.choices[0].message.tool_calls]
        same_message(message, streamed(claude, **ask))


def test_auto_reads_the_models_own_calls(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    """Steered into Hermes' format, the model's text is read back: the text before the
    calls as a text block, each call as a tool_use block, as the chat endpoint reads them."""
    steer = {**GREEDY, "guided_regex": f"Checking\\.\\n{WEATHER_CALL}(\\n{WEATHER_CALL})?"}
    message = claude.messages.create(model="stories", max_tokens=250, messages=USER, tools=ANTHROPIC_TOOLS,
                                     extra_body=steer)
    chat = oai.chat.completions.create(model="stories", max_tokens=250, messages=USER, tools=TOOLS, temperature=0,
                                       extra_body={"guided_regex": steer["guided_regex"]}).choices[0].message
    assert message.stop_reason == "tool_use" and message.content[0].type == "text"
    assert message.content[0].text == chat.content == "Checking.\n"
    calls = tool_uses(message, {"get_weather"})
    assert calls and calls == [(c.function.name, json.loads(c.function.arguments)) for c in chat.tool_calls]
    none = claude.messages.create(model="stories", max_tokens=250, messages=USER, tools=ANTHROPIC_TOOLS,
                                  tool_choice={"type": "none"}, extra_body=steer)
    assert [b.type for b in none.content] == ["text"] and "<tool_call>" in none.content[0].text
    assert none.stop_reason == "end_turn"


def test_a_tool_result_goes_back(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    """A tool_use answered by a tool_result renders as the OpenAI conversation with the call
    and a tool message does; the next turn answers."""
    first = claude.messages.create(model="stories", max_tokens=120, messages=USER, tools=ANTHROPIC_TOOLS,
                                   tool_choice={"type": "tool", "name": "get_time"}, extra_body=GREEDY)
    [call] = first.content
    result = "It is noon in CET."
    for content in (result, [{"type": "text", "text": result}]):
        turns = [*USER, {"role": "assistant", "content": first.content},  # the SDK's blocks, sent back as they came
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": content}]}]
        second = claude.messages.create(model="stories", max_tokens=16, messages=turns, tools=ANTHROPIC_TOOLS,
                                        extra_body=GREEDY)
        chat = oai.chat.completions.create(model="stories", max_tokens=16, tools=TOOLS, temperature=0, messages=[
            *USER, {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": result}])
        assert second.stop_reason == "max_tokens" and second.content[0].text == chat.choices[0].message.content
        assert second.usage.input_tokens == chat.usage.prompt_tokens
        counted = claude.messages.count_tokens(model="stories", messages=turns, tools=ANTHROPIC_TOOLS)
        assert counted.input_tokens == second.usage.input_tokens


def test_a_call_cut_short_keeps_what_it_has(claude: anthropic.Anthropic) -> None:
    """max_tokens inside a call: the tool_use block holds the input as far as it got, as
    the SDK reads the stream's unfinished JSON."""
    ask = dict(model="stories", max_tokens=8, messages=USER, tools=ANTHROPIC_TOOLS,
               tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    message = claude.messages.create(**ask)  # type: ignore[arg-type]
    assert message.stop_reason == "max_tokens" and message.content[0].type == "tool_use"
    same_message(message, streamed(claude, **ask))


def test_structured_output_config(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    message = claude.messages.create(model="stories", max_tokens=40, messages=USER, extra_body={
        **GREEDY, "output_config": {"format": {"type": "json_schema", "schema": schema}}})  # older SDKs lack the argument
    jsonschema.validate(json.loads(message.content[0].text), schema)
    chat = oai.chat.completions.create(model="stories", max_tokens=40, messages=USER, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "output", "schema": schema}})
    assert message.content[0].text == chat.choices[0].message.content and message.stop_reason == "end_turn"


# -- thinking --------------------------------------------------------------------------------------

def test_thinking_comes_first(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A thinking budget closes the think block (the story model never would); the thinking
    is a thinking block before the text, as the chat endpoint's reasoning_content; disabled,
    there is none."""
    with serve(tmp_path, THINKING_TEMPLATE) as server:
        claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        ask = dict(model="stories", max_tokens=40, messages=messages,
                   thinking={"type": "enabled", "budget_tokens": STEER["max_reasoning_tokens"]},
                   extra_body={**GREEDY, "guided_regex": STEER["guided_regex"]})
        message = claude.messages.create(**ask)  # type: ignore[arg-type]
        chat = oai.chat.completions.create(model="stories", max_tokens=40, messages=messages, temperature=0,
                                           extra_body=STEER).choices[0].message
        thinking, text = message.content
        assert thinking.type == "thinking" and thinking.signature == "" and thinking.thinking.strip()
        assert (thinking.thinking, text.text) == (chat.model_extra["reasoning_content"], chat.content)
        assert message.stop_reason == "end_turn"
        same_message(message, streamed(claude, **ask))
        off = claude.messages.create(model="stories", max_tokens=8, messages=messages, thinking={"type": "disabled"},
                                     extra_body=GREEDY)
        chat_off = oai.chat.completions.create(model="stories", max_tokens=8, messages=messages, temperature=0,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert [b.type for b in off.content] == ["text"] and off.content[0].text == chat_off.choices[0].message.content
        # Earlier thinking in the history is dropped, as templates drop it
        history = [*messages, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm.", "signature": ""},
                                                                {"type": "text", "text": "4."}]},
                   {"role": "user", "content": "And 3 + 3?"}]
        plain = [*messages, {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 + 3?"}]
        assert claude.messages.count_tokens(model="stories", messages=history).input_tokens == \
            claude.messages.count_tokens(model="stories", messages=plain).input_tokens


# -- errors and keys -------------------------------------------------------------------------------

def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    return body["error"]["message"]


def test_errors_come_in_anthropics_shape(claude: anthropic.Anthropic, server: RunningServer) -> None:
    with pytest.raises(anthropic.NotFoundError) as found:
        claude.messages.create(model="nope", max_tokens=4, messages=USER)
    assert found.value.body["error"]["type"] == "not_found_error" and "nope" in found.value.body["error"]["message"]
    bad = [
        ({"max_tokens": 0}, "max_tokens"),
        ({"extra_body": {"temperature": 1.5}}, "temperature"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "stories does not read images"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "file", "file_id": "f"}}]}]}, "not read: send it inline"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
         "document blocks are not supported"),
        ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "not among the tools"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
         "tool_use blocks belong in assistant messages"),
        ({"extra_body": {"guided_regex": "a", "seed": "one"}}, "seed"),
    ]
    for change, says in bad:
        ask = {"model": "stories", "max_tokens": 4, "messages": USER, **change}
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.create(**ask)  # type: ignore[arg-type]
        assert refused.value.body["error"]["type"] == "invalid_request_error"
        assert says in refused.value.body["error"]["message"]
    url = server.url + "/v1/messages"
    anthropic_error(httpx.post(url, json={"model": "stories", "messages": USER}), 400, "invalid_request_error")
    assert "JSON" in anthropic_error(httpx.post(url, content=b'{"model": ', headers={
        "content-type": "application/json"}), 400, "invalid_request_error")
    anthropic_error(httpx.post(url, content=b"{}"), 415, "invalid_request_error")  # refused by the guard
    anthropic_error(httpx.get(url), 405, "invalid_request_error")
    anthropic_error(httpx.post(url + "/batches", json={}), 404, "not_found_error")
    anthropic_error(httpx.post(url + "/count_tokens", json={"model": "nope", "messages": USER}), 404,
                    "not_found_error")
    # The OpenAI routes keep OpenAI's shape
    openai_error = httpx.post(server.url + "/v1/chat/completions", json={"model": "nope", "messages": USER}).json()
    assert set(openai_error["error"]) == {"message", "type", "param", "code"}


def test_x_api_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Anthropic's clients send their key as x-api-key: taken on every route, as Bearer is."""
    with serve(tmp_path, HERMES_STYLE, api_key="s3cret") as server:
        ask = dict(model="stories", max_tokens=4, messages=USER)
        assert anthropic.Anthropic(base_url=server.url, api_key="s3cret", max_retries=0).messages.create(**ask).content
        bearer = anthropic.Anthropic(base_url=server.url, auth_token="s3cret", max_retries=0)  # Authorization: Bearer
        assert bearer.messages.count_tokens(model="stories", messages=USER).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as refused:
            anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(**ask)
        assert refused.value.body["error"]["type"] == "authentication_error"
        assert "x-api-key" in refused.value.body["error"]["message"]
        assert httpx.get(server.url + "/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
        assert httpx.get(server.url + "/v1/models", headers={"x-api-key": "wrong"}).status_code == 401


# -- without a server ------------------------------------------------------------------------------

def test_a_request_is_the_chat_request_it_amounts_to() -> None:
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 9, "stop_sequences": ["\n\n"], "temperature": 0.5, "top_k": 3,
        "system": [{"type": "text", "text": "A."}, {"type": "text", "text": "B."}],
        "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "disabled"}, "seed": 5, "unknown": 1,
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": "s"},
                                              {"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_time",
                                               "input": {"zone": "CET"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "noon"},
                                         {"type": "text", "text": "So?"}]},
        ]})
    chat = body.chat_request()
    assert [m.plain() for m in chat.messages] == [
        {"role": "system", "content": "A.\nB."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "noon"},
        {"role": "user", "content": "So?"},
    ]
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_k, chat.seed) == (9, ["\n\n"], 0.5, 3, 5)
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False and chat.tools == TOOLS
    assert chat.template_variables() == {"enable_thinking": False} and chat.add_generation_prompt
    enabled = MessagesRequest.model_validate({"model": "m", "max_tokens": 9, "messages": USER,
                                              "thinking": {"type": "enabled", "budget_tokens": 64}}).chat_request()
    assert enabled.max_reasoning_tokens == 64 and enabled.template_variables() == {"enable_thinking": True}


def test_a_cut_short_input_is_read_as_the_sdk_reads_it() -> None:
    """Every prefix of a call's arguments gives the object the SDK's stream reader (jiter,
    partial mode) gives."""
    full = '{"city": "Pa\\"ris", "unit": ["c", 1, true, null, {}], "n": {"x": -1.5e3, "y": []}, "z": false}'
    for end in range(len(full) + 1):
        text = full[:end]
        assert object_so_far(text) == (from_json(text.encode(), partial_mode=True) if text else {}), text
    assert object_so_far("[1, 2]") == {} and object_so_far("not json") == {}


def test_localserves_speculative_decoding_field_is_taken(claude: anthropic.Anthropic, server: RunningServer) -> None:
    """``num_speculative_tokens`` in the body (extra_body): drafts verified, the same reply;
    out of range, Anthropic's 400."""
    ask = dict(model="stories", max_tokens=40, messages=[{"role": "user", "content": "Tell me a story."}])
    plain = claude.messages.create(**ask, extra_body={**GREEDY, "num_speculative_tokens": 0})  # type: ignore[arg-type]
    before = draft_tokens_verified(server)
    drafted = claude.messages.create(**ask, extra_body={**GREEDY, "num_speculative_tokens": 4})  # type: ignore[arg-type]
    assert drafted.content == plain.content
    assert draft_tokens_verified(server) > before
    with pytest.raises(anthropic.BadRequestError, match="num_speculative_tokens"):
        claude.messages.create(**ask, extra_body={"num_speculative_tokens": 99})  # type: ignore[arg-type]

