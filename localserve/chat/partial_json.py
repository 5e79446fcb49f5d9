"""A JSON object as far as its text goes: what a tool call's arguments hold when
``max_tokens`` cut the call short (Anthropic's API returns a ``tool_use`` block's input as
an object, never as text). Members are kept while whole; an unfinished string, number or
literal is left out, the containers still open are closed (as the anthropic SDK reads a
stream's unfinished ``partial_json``)."""

from __future__ import annotations

import json
from typing import Any

_SPACE = " \t\r\n"
_CLOSER = {"{": "}", "[": "]"}


def object_so_far(text: str) -> dict[str, Any]:
    """The object ``text`` holds or begins; ``{}`` when it is not an object's text."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = _closed(text)
    return value if isinstance(value, dict) else {}


def _closed(text: str) -> Any:
    """The value of ``text`` cut after its last whole member and its containers closed."""
    stack: list[str] = []
    key_next = False  # in an object, the next string is a key
    cut, closers = 0, ""  # where the text may end, and what closes it there
    at = 0
    while at < len(text):
        char = text[at]
        if char in _SPACE or char in ",:":
            key_next = (char == "," and stack[-1:] == ["{"]) or (key_next and char != ":")
            at += 1
            continue
        if char in "{[":
            stack.append(char)
            key_next = char == "{"
            at += 1
        elif char in "}]":
            if not stack:
                break
            stack.pop()
            at += 1
        elif char == '"':
            end = _string_end(text, at)
            if end is None:
                break  # an unfinished string: left out
            at = end
            if key_next:
                continue  # a key is whole only with its value
        else:
            end = at
            while end < len(text) and text[end] not in _SPACE + ",:]}":
                end += 1
            try:
                json.loads(text[at:end])
            except json.JSONDecodeError:
                break  # an unfinished number or literal ("tr", "1.")
            at = end
        cut, closers = at, "".join(_CLOSER[c] for c in reversed(stack))
    try:
        return json.loads(text[:cut] + closers)
    except json.JSONDecodeError:
        return None


def _string_end(text: str, at: int) -> int | None:
    """One past the closing quote of the string that opens at ``text[at]``."""
    escaped = False
    for i in range(at + 1, len(text)):
        if escaped:
            escaped = False
        elif text[i] == "\\":
            escaped = True
        elif text[i] == '"':
            return i + 1
    return None
