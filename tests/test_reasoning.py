"""Reasoning split from the answer for ``<think>`` models: the splitter on its own
(streamed in pieces of every size equals split whole), and through the openai SDK on the
stories260K model given a thinking template, its block closed by a thinking budget (a story
model never closes it) and its answer steered by a regex or a JSON schema, which hold the
answer after the block, not the thinking; the Python API reads replies as the server does."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from localserve import LLM, OutputFormat, SamplingParams

from localserve.chat.reply import ReplyFormat, whole
from localserve.chat.reasoning import ReasoningSplitter, starts_inside, thinks

from .server_util import stories_client, stories_with_template

TEXTS = [
    ("<think>\nLet me see.</think>\n\nIt is 4.", False, ("\nLet me see.", "\n\nIt is 4.")),
    ("Let me see.</think>It is 4.", True, ("Let me see.", "It is 4.")),
    ("It is 4.", False, (None, "It is 4.")),
    ("Still thinking <thi", True, ("Still thinking <thi", "")),  # cut off by max_tokens
    ("a < b </thin", True, ("a < b </thin", "")),
    ("x</think>y</think>z", True, ("x", "y</think>z")),  # one block; the answer may quote the tag
]


@pytest.mark.parametrize("text,inside,expected", TEXTS)
def test_split_and_streamed_split_agree(text: str, inside: bool, expected: tuple) -> None:
    message = whole(ReplyFormat(opens_thinking=inside), text)
    assert (message.reasoning_content, message.content) == expected and not message.tool_calls
    for size in range(1, len(text) + 1):
        splitter, thinking, answer = ReasoningSplitter(inside=inside), "", ""
        for start in range(0, len(text), size):
            more = splitter.feed(text[start:start + size])
            thinking, answer = thinking + more[0], answer + more[1]
        more = splitter.finish()
        assert (thinking + more[0], answer + more[1]) == (expected[0] or "", expected[1]), size


def test_template_detection() -> None:
    assert thinks("{{ content.split('</think>')[-1] }}") and not thinks("{{ content }}")
    assert starts_inside("<|Assistant|><think>\n") and not starts_inside("<think>\n\n</think>\n\n")


# DeepSeek-R1's way: the generation prompt opens the block, unless enable_thinking is false
# (then it writes an empty one, as Qwen3's does).
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}{# </think> #}"
)
# The story model never closes the block itself: a budget closes it, and a regex (which
# holds the answer only, after the block) steers the answer.
STEER = {"max_reasoning_tokens": 8, "guided_regex": r"\n\n[A-Z][a-z]{2,8}\."}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with stories_client(tmp_path_factory.mktemp("models"), THINKING_TEMPLATE) as client:
        yield client


MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def test_reasoning_content_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="stories", messages=MESSAGES, temperature=0, max_tokens=40,
                                           extra_body=STEER)
    message = whole.choices[0].message
    thinking, answer = message.model_extra["reasoning_content"], message.content
    assert " " in thinking and answer.startswith("\n\n") and answer.endswith(".")  # the format held the answer only
    stream = client.chat.completions.create(model="stories", messages=MESSAGES, temperature=0, max_tokens=40,
                                            extra_body=STEER, stream=True)
    pieces = {"reasoning_content": "", "content": ""}
    for chunk in stream:
        for choice in chunk.choices:
            pieces["content"] += choice.delta.content or ""
            pieces["reasoning_content"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
    assert pieces == {"reasoning_content": thinking, "content": answer}


def test_thinking_turned_off_through_chat_template_kwargs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="stories", messages=MESSAGES, temperature=0, max_tokens=8,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    assert message.content and message.model_extra["reasoning_content"] is None


def test_reserved_template_variables_are_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        client.chat.completions.create(model="stories", messages=MESSAGES, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"messages": []}})


def test_a_thinking_budget_closes_the_block(client: openai.OpenAI) -> None:
    """After max_reasoning_tokens tokens of thinking the engine writes </think> itself and
    the model goes on to answer; without a budget the story model never closes the block."""
    free = client.chat.completions.create(model="stories", messages=MESSAGES, temperature=0, max_tokens=30)
    assert free.choices[0].message.content == "" and free.choices[0].message.model_extra["reasoning_content"]
    for stream in (False, True):
        reply = client.chat.completions.create(model="stories", messages=MESSAGES, temperature=0, max_tokens=30,
                                               stream=stream, extra_body={"max_reasoning_tokens": 6})
        if stream:
            thinking = answer = ""
            for chunk in reply:
                for choice in chunk.choices:
                    answer += choice.delta.content or ""
                    thinking += (choice.delta.model_extra or {}).get("reasoning_content") or ""
        else:
            message = reply.choices[0].message
            thinking, answer = message.model_extra["reasoning_content"], message.content
        assert free.choices[0].message.model_extra["reasoning_content"].startswith(thinking) and thinking
        assert answer  # the story goes on after the forced </think>


ANSWER = {"type": "object", "properties": {"answer": {"type": "integer", "enum": [3, 4, 5]}}, "required": ["answer"],
          "additionalProperties": False}


def test_a_format_holds_the_answer_after_the_thinking(client: openai.OpenAI) -> None:
    """A JSON schema with a thinking budget: the thinking is free text, the answer after
    the forced </think> validates; a required tool call comes after the thinking too."""
    reply = client.chat.completions.create(
        model="stories", messages=MESSAGES, temperature=0, max_tokens=60, extra_body={"max_reasoning_tokens": 8},
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}})
    message = reply.choices[0].message
    assert " " in message.model_extra["reasoning_content"] and reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content), ANSWER)
    tool = {"type": "function", "function": {"name": "add", "parameters": ANSWER}}
    called = client.chat.completions.create(model="stories", messages=MESSAGES, temperature=0, max_tokens=60,
                                            tools=[tool], tool_choice="required", parallel_tool_calls=False,
                                            extra_body={"max_reasoning_tokens": 8})
    message = called.choices[0].message
    assert message.model_extra["reasoning_content"] and called.choices[0].finish_reason == "tool_calls"
    [call] = message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ANSWER)


def test_python_chat_reads_thinking_as_the_server_does(client: openai.OpenAI, tmp_path) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(stories_with_template(tmp_path, THINKING_TEMPLATE), device="cpu", num_kv_blocks=64)
    [out] = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=40, output_format=OutputFormat(
        "regex", STEER["guided_regex"])), max_reasoning_tokens=STEER["max_reasoning_tokens"])
    served = client.chat.completions.create(model="stories", messages=MESSAGES, temperature=0, max_tokens=40,
                                            extra_body=STEER).choices[0].message
    assert (out.message.reasoning_content, out.message.content) == \
        (served.model_extra["reasoning_content"], served.content)
    assert out.text == out.message.reasoning_content + "</think>" + out.message.content
    [off] = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8),
                     chat_template_kwargs={"enable_thinking": False})
    assert off.message.reasoning_content is None and off.message.content
