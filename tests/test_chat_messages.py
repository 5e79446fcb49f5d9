"""OpenAI chat messages as templates expect them: a tool call's JSON-string arguments
become the object templates print with ``tojson`` (checked against transformers rendering
the HF-style message, arguments as an object), and ``content: null`` renders whether the
template tests for null or concatenates the content."""

from __future__ import annotations

import json
from typing import Any

import pytest

from localserve.chat.messages import render_messages, template_messages
from localserve.errors import LocalserveError
from localserve.server.protocol import ChatMessage
from localserve.text.chat_template import ChatTemplate

from .test_chat_template import TEMPLATES, TOOL_CHAT, WEATHER_TOOL, hf_render  # noqa: F401  (a fixture)

# TOOL_CHAT as an OpenAI client sends it: arguments as a JSON string, content null.
WIRE_CHAT = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                                  for c in m["tool_calls"]], "content": None} if "tool_calls" in m else m
             for m in TOOL_CHAT]

# DeepSeek-R1's tool turns, as its template writes them: a null-content test, arguments
# through tojson, the reasoning cut from earlier assistant turns.
DEEPSEEK_LIKE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<U>{{ m['content'] }}{% endif %}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] %}{% for t in m['tool_calls'] %}"
    "<call>{{ t['function']['name'] }} {{ t['function']['arguments'] | tojson }}</call>{% endfor %}<end>{% endif %}"
    "{% if m['role'] == 'assistant' and m['content'] is not none %}{% set c = m['content'] %}"
    "{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}{{ '<A>' + c + '<end>' }}{% endif %}"
    "{% if m['role'] == 'tool' %}<out>{{ m['content'] }}</out>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<A>{% endif %}"
)


def wire(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the server hands them on, once validated."""
    return [ChatMessage.model_validate(m).plain() for m in messages]


def test_arguments_become_objects_and_render_as_transformers_renders_them(hf_render) -> None:  # noqa: F811
    source = (TEMPLATES / "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja").read_text()
    template = ChatTemplate(source, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    ours = render_messages(wire(WIRE_CHAT), lambda plain, **how: template.render(plain, tools=[WEATHER_TOOL], **how))
    expected = hf_render(source, TOOL_CHAT, tools=[WEATHER_TOOL], add_generation_prompt=True,
                         bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    assert ours == expected
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in ours  # once encoded, not twice
    # Text that is not a JSON object stays as sent.
    odd = wire([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[1, 2"}}]}])
    assert template_messages(odd)[0]["tool_calls"][0]["function"]["arguments"] == "[1, 2"


def test_null_content_where_the_template_tests_for_null() -> None:
    template = ChatTemplate(DEEPSEEK_LIKE)
    text = render_messages(wire(WIRE_CHAT[1:]), template.render)
    assert '<call>get_weather {"city": "Paris", "unit": "celsius"}</call><end><out>' in text
    assert "<A><end>" not in text  # no empty assistant turn for the call-only message


def test_null_content_where_the_template_concatenates_it() -> None:
    source = (TEMPLATES / "microsoft-Phi-3.5-mini-instruct.jinja").read_text()
    template = ChatTemplate(source, bos_token="<s>", eos_token="<|endoftext|>")
    messages = wire([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "user", "content": "?"}])
    with pytest.raises(Exception):
        template.render(template_messages(messages))  # as sent, Phi-3.5 cannot add null to a string
    assert render_messages(messages, template.render) == \
        "<|user|>\nHi<|end|>\n<|assistant|>\n<|end|>\n<|user|>\n?<|end|>\n<|assistant|>\n"


def test_images_are_laid_out_as_template_parts_in_order() -> None:
    from localserve.chat.messages import image_sources

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Two?", "images": ["AAAA", "BBBB"]},
                {"role": "user", "content": [{"type": "text", "text": "Then "},
                                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,CCCC"}},
                                             {"type": "text", "text": " this."}]}]
    assert image_sources(messages) == ["AAAA", "BBBB", "data:image/png;base64,CCCC"]
    assert [m["content"] for m in template_messages(messages)] == [
        "Be brief.",
        [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Two?"}],
        [{"type": "text", "text": "Then "}, {"type": "image"}, {"type": "text", "text": " this."}]]
    assert all("images" not in m for m in template_messages(messages))
    with pytest.raises(LocalserveError, match="image_url part needs"):
        image_sources([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
