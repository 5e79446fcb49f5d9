"""OpenAI chat messages as chat templates expect them.

Two things differ between what an OpenAI client sends and what templates were written for
(the HF-style dicts transformers passes):

- an assistant turn's ``tool_calls[].function.arguments`` is a JSON *string* on the wire,
  while templates print it with ``| tojson`` (Llama 3.1, DeepSeek, Hermes, Qwen): a string
  would come out encoded twice. It is parsed into its object first, as vLLM does (text
  that is not a JSON object is left as it is);
- an assistant turn that only calls tools has ``content: null``. transformers drops null
  keys before rendering, and most templates are written for that; some test for null
  instead (DeepSeek-R1: ``content is not none``, then ``'...' + content``), others
  concatenate it whatever it is (Phi-3.5: ``content + '<|end|>'``). So a conversation is
  rendered as transformers renders it; if the template fails, with null content kept; if
  it fails again, with ``""`` in its place.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..errors import LocalserveError

Message = dict[str, Any]  # an OpenAI chat message; its content a string, parts (with images) or None


def image_sources(messages: list[Message]) -> list[str]:
    """The messages' images in the order their prompt lays them out: each message's
    ``images`` (Ollama's: base64, before its text), then its ``image_url`` parts' URLs."""
    sources: list[str] = []
    for message in messages:
        sources.extend(message.get("images") or [])
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if part.get("type") == "image_url":
                    url = (part.get("image_url") or {}).get("url")
                    if not isinstance(url, str):
                        raise LocalserveError('an image_url part needs {"image_url": {"url": "data:..."}}')
                    sources.append(url)
    return sources


def _template_content(message: Message) -> Any:
    """The content as templates take it: with images, a list of text parts and
    ``{"type": "image"}`` where each image goes (the template writes the model's marker)."""
    content = message.get("content")
    if not message.get("images") and not isinstance(content, list):
        return content
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in message.get("images") or []]
    if isinstance(content, list):
        parts += [{"type": "image"} if part.get("type") == "image_url" else part for part in content]
    elif content:
        parts.append({"type": "text", "text": content})
    return parts


def template_messages(messages: list[Message], empty_content: bool = False) -> list[Message]:
    """The messages as templates take them; ``empty_content``: ``""`` for null content."""
    plain = []
    for message in messages:
        entry = {key: value for key, value in message.items() if key != "images"}
        entry["content"] = _template_content(message)
        if empty_content and entry["content"] is None:
            entry["content"] = ""
        if message.get("tool_calls"):
            entry["tool_calls"] = [_parsed_arguments(call) for call in message["tool_calls"]]
        plain.append(entry)
    return plain


def render_messages(messages: list[Message], render: Callable[..., str]) -> str:
    """``render(plain_messages, keep_null_content=...)`` the messages, trying the ways null
    content can be given (above) in turn while the template fails on them."""
    # (null content as "", keep_null_content)
    ways = [(False, False)]
    if any(message.get("content") is None for message in messages):
        ways += [(False, True), (True, False)]
    for attempt, (empty, keep_null) in enumerate(ways, 1):
        try:
            return render(template_messages(messages, empty_content=empty), keep_null_content=keep_null)
        except LocalserveError:
            if attempt == len(ways):
                raise
    raise AssertionError("unreachable")


def _parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}
