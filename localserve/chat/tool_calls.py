"""Tool calls: read from a model's text in its family's format as it is generated, and
forced by constrained decoding when the client requires them.

Formats (the parser is chosen from the chat template, or named with ``serve --tool-parser``):

- ``hermes`` (Hermes 2 Pro/3, Qwen2.5, Qwen3, QwQ): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated;
- ``llama3_json`` (Llama 3.1-3.3): ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``, several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` per call (Mistral Small 3.2: ``name[CALL_ID]id[ARGS]{...}``);
- ``deepseek``: inside ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``, each call
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>name`` then its arguments in a ```` ```json ````
  fence (V3, R1), or ``<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}`` (V3.1), then ``<｜tool▁call▁end｜>``;
- ``pythonic`` (Llama 3.2/4's pythonic mode): ``[name(key=value, ...), ...]``, read with
  ``ast`` (literals only; nothing is evaluated).

A call is streamed once its name is read: the arguments are the model's own JSON text,
sent piece by piece as they are generated (as OpenAI streams them), so that the pieces add
up to what a whole reply returns. Pythonic calls are converted to JSON, so each is sent
when whole.

``tool_choice: "required"`` or a named function is enforced instead: the output is held to
a JSON schema (llguidance) whose arguments validate against the tool's parameters.
"""

from __future__ import annotations

import ast
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.output_format import OutputFormat
from ..errors import LocalserveError
from .reasoning import partial_marker


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # as the model wrote them: the JSON text of an object (or as far as it got)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class _Seen:
    """A call as far as the text shows it: its name is whole, its arguments may not be
    (what is there never changes as more text comes, it only grows)."""

    name: str
    arguments: str


# Each format's reader: (text, final) -> (where the calls begin, or None while there are
# none; the calls seen). ``final``: the text is complete; otherwise a value or a marker the
# text ends inside is waited for.
Scan = Callable[[str, bool], tuple["int | None", list[_Seen]]]

_SPACE = " \t\r\n"


class _NotACall(Exception):
    pass


def _skip(text: str, at: int, chars: str = _SPACE) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


def _json_end(text: str, at: int, final: bool) -> int | None:
    """One past the end of the JSON value that begins at ``text[at]``; None while the text
    ends inside it. Strings and brackets are matched; the value is not checked."""
    if text[at] not in '{["':  # a number, true, false or null: up to a delimiter
        end = at
        while end < len(text) and text[end] not in ",:}]" + _SPACE:
            end += 1
        return end if end < len(text) or final else None
    return _closing(text, at, '"', "{[", "}]")


def _closing(text: str, at: int, quotes: str, opening: str, closing: str) -> int | None:
    """One past where the bracketed value (or lone string) starting at ``text[at]`` ends,
    strings in ``quotes`` skipped; None while the text ends inside it."""
    depth, quote, escaped = 0, "", False
    for i in range(at, len(text)):
        char = text[i]
        if quote:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = ""
                if depth == 0:
                    return i + 1
        elif char in quotes:
            quote = char
        elif char in opening:
            depth += 1
        elif char in closing:
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise _NotACall from exc


def _arguments(raw: str | None, whole: bool) -> str:
    """The arguments as sent on: the model's own text; a JSON string holding the object
    (some models write them so) once it is whole; ``{}`` for none or null."""
    if raw is None or (whole and raw == "null"):
        return "{}" if whole else ""
    if raw.startswith('"'):
        if not whole:
            return ""
        value = _load(raw)
        return value if isinstance(value, str) else raw
    return raw


def _call_object(text: str, at: int, final: bool, argument_keys: tuple[str, ...]) -> tuple[_Seen | None, int | None]:
    """The call in the JSON object at ``text[at]`` ('{'), once its name is read and its
    arguments have begun (else None), and one past the object's end (None while open)."""
    name: str | None = None
    raw: str | None = None  # the arguments' text
    raw_whole = False

    def seen(closed: bool) -> _Seen | None:
        if name is None or (raw is None and not closed):
            return None
        return _Seen(name, _arguments(raw, raw_whole or closed))

    i = at + 1
    while True:
        i = _skip(text, i)
        if i == len(text):
            return seen(False), None
        if text[i] == "}":
            if name is None:
                raise _NotACall
            return seen(True), i + 1
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            raise _NotACall
        key_end = _json_end(text, i, final)
        if key_end is None:
            return seen(False), None
        key = _load(text[i:key_end])
        i = _skip(text, key_end)
        if i < len(text) and text[i] != ":":
            raise _NotACall
        i = _skip(text, i + 1)
        if i >= len(text):
            return seen(False), None
        end = _json_end(text, i, final)
        if key == "name":
            if end is None:
                return seen(False), None
            name = _load(text[i:end])
            if not isinstance(name, str) or not name:
                raise _NotACall
        elif key in argument_keys:
            raw, raw_whole = text[i:end] if end is not None else text[i:], end is not None
            if end is None:
                return seen(False), None
        elif end is None:
            return seen(False), None
        i = end


def _call_objects(text: str, at: int, final: bool, argument_keys: tuple[str, ...], separators: str) -> list[_Seen]:
    """Call objects one after another from ``at`` (between them whitespace and
    ``separators``), up to anything else."""
    calls = []
    while True:
        at = _skip(text, at, _SPACE + separators)
        if at == len(text) or text[at] != "{":
            return calls
        try:
            call, end = _call_object(text, at, final, argument_keys)
        except _NotACall:
            return calls
        if call is not None:
            calls.append(call)
        if end is None:
            return calls
        at = end


def _region(text: str, begin: int, end_marker: str, final: bool) -> tuple[str, bool]:
    """The text from ``begin`` to ``end_marker`` (or to the end, less a partial marker
    while more may come), and whether it is complete."""
    end = text.find(end_marker, begin)
    if end >= 0:
        return text[begin:end], True
    rest = text[begin:]
    return (rest, True) if final else (rest[:len(rest) - partial_marker(rest, end_marker)], False)


def _hermes(text: str, final: bool) -> tuple[int | None, list[_Seen]]:
    start = text.find("<tool_call>")
    if start < 0:
        return None, []
    calls, at = [], start
    while at >= 0:
        body, whole = _region(text, at + len("<tool_call>"), "</tool_call>", final)
        found = _call_objects(body, 0, whole, ("arguments",), "")
        calls += found or (_python_dict_call(body) if whole else [])
        if not whole:
            break
        at = text.find("<tool_call>", at + len("<tool_call>") + len(body))
    return start, calls


def _python_dict_call(body: str) -> list[_Seen]:
    """A call written as a Python dict (Hermes 2 Pro does: ``{'name': ..., 'arguments': {...}}``),
    read with ``ast.literal_eval`` once its tag has closed; literals only."""
    try:
        value = ast.literal_eval(body.strip())
        if isinstance(value, dict) and isinstance(value.get("name"), str) and value["name"] \
                and isinstance(value.get("arguments", {}), dict):
            return [_Seen(value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False))]
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        pass
    return []


def _llama3_json(text: str, final: bool) -> tuple[int | None, list[_Seen]]:
    tag = text.find("<|python_tag|>")
    if tag >= 0:
        return tag, _call_objects(text, tag + len("<|python_tag|>"), final, ("parameters", "arguments"), ";")
    at = _skip(text, 0)
    if at == len(text) or text[at] != "{":
        return None, []
    return 0, _call_objects(text, at, final, ("parameters", "arguments"), ";")


def _mistral(text: str, final: bool) -> tuple[int | None, list[_Seen]]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return None, []
    calls: list[_Seen] = []
    at = start
    while at >= 0:
        part, whole = _region(text, at + len("[TOOL_CALLS]"), "[TOOL_CALLS]", final)
        first = _skip(part, 0)
        if part.startswith("[", first):  # [{"name": ..., "arguments": ...}, ...]
            calls += _call_objects(part, first + 1, whole, ("arguments",), ",")
        else:  # name[ARGS]{...}, or name[CALL_ID]id[ARGS]{...} (Mistral Small 3.2)
            args = part.find("[ARGS]")
            if args < 0:
                break
            name = part[:args].split("[CALL_ID]")[0].strip()
            if not name or any(c in name for c in _SPACE + '{["'):
                break
            value = _skip(part, args + len("[ARGS]"))
            end = _json_end(part, value, whole) if value < len(part) else None
            raw = part[value:end] if end is not None else part[value:]
            calls.append(_Seen(name, _arguments(raw or None, end is not None)))
        if not whole:
            break
        at = text.find("[TOOL_CALLS]", at + len("[TOOL_CALLS]") + len(part))
    return start, calls


def _deepseek(text: str, final: bool) -> tuple[int | None, list[_Seen]]:
    """DeepSeek-V3/R1: ``function<sep>name``, a newline, the arguments in a json fence;
    V3.1: ``name<sep>`` and the arguments straight after."""
    start = text.find("<｜tool▁calls▁begin｜>")
    if start < 0:
        return None, []
    calls = []
    at = text.find("<｜tool▁call▁begin｜>", start)
    while at >= 0:
        body, whole = _region(text, at + len("<｜tool▁call▁begin｜>"), "<｜tool▁call▁end｜>", final)
        head, sep, rest = body.partition("<｜tool▁sep｜>")
        if not sep:
            break
        if head.strip() in ("", "function"):
            name, newline, rest = rest.partition("\n")
            if not newline and not whole:
                break  # the name may go on
            value = _skip(rest, 0)
            if not whole and len(rest) - value < 3 and "```".startswith(rest[value:]):
                break  # the fence may be coming
            if rest.startswith("```", value):
                fence_end = rest.find("\n", value)
                value = _skip(rest, fence_end) if fence_end >= 0 else len(rest)
        else:
            name, value = head, _skip(rest, 0)
        name = name.strip()
        if not name:
            break
        if value < len(rest):
            end = _json_end(rest, value, whole)
            calls.append(_Seen(name, _arguments(rest[value:end] if end is not None else rest[value:], end is not None)))
        elif whole:
            calls.append(_Seen(name, "{}"))
        if not whole:
            break
        at = text.find("<｜tool▁call▁begin｜>", at + len("<｜tool▁call▁begin｜>") + len(body))
    return start, calls


def _python_call_end(text: str, at: int) -> int | None:
    """One past the ``)`` that closes the call ``name(...)`` at ``text[at]``; None while the
    text ends inside it. Raises _NotACall for anything but a name and a parenthesis."""
    i = at
    while i < len(text) and (text[i].isalnum() or text[i] in "_."):
        i += 1
    if i == len(text):
        return None
    if i == at or text[i] != "(":
        raise _NotACall
    return _closing(text, i, "'\"", "([{", ")]}")


def _python_call(source: str) -> _Seen:
    """``name(key=literal, ...)`` read with ``ast``: literals only, nothing is evaluated."""
    try:
        node = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise _NotACall from exc
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise _NotACall
    try:
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        return _Seen(node.func.id, json.dumps(arguments, ensure_ascii=False))
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError) as exc:  # not a literal JSON holds
        raise _NotACall from exc


_PYTHON_TAGS = ("<|python_start|>", "<|python_tag|>")


def _pythonic(text: str, final: bool) -> tuple[int | None, list[_Seen]]:
    """``[name(key=value, ...), ...]`` making up the reply (Llama 4 may wrap it in
    ``<|python_start|>...<|python_end|>``, Llama 3.2 put ``<|python_tag|>`` before it); each
    call is sent once it is whole."""
    tags = [(at, tag) for tag in _PYTHON_TAGS if (at := text.find(tag)) >= 0]
    if tags:
        start, tag = min(tags)
        at = _skip(text, start + len(tag))
    else:
        start, at = 0, _skip(text, 0)
    if at == len(text) or text[at] != "[":
        return None, []
    calls = []
    at += 1
    while True:
        at = _skip(text, at, _SPACE + ",")
        if at == len(text) or text[at] == "]":
            return start, calls
        try:
            end = _python_call_end(text, at)
            if end is None:
                return start, calls
            calls.append(_python_call(text[at:end]))
        except _NotACall:
            return start, calls
        at = end


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How a family writes its calls: the reader, the markers a call may begin with
    mid-reply, and the opening character of calls that make up the whole reply
    ("" when the whole reply is calls whatever it starts with)."""

    scan: Scan
    markers: tuple[str, ...] = ()
    opener: str | None = None


PARSERS = {
    "hermes": CallFormat(_hermes, ("<tool_call>",)),
    "llama3_json": CallFormat(_llama3_json, ("<|python_tag|>",), "{"),
    "mistral": CallFormat(_mistral, ("[TOOL_CALLS]",)),
    "deepseek": CallFormat(_deepseek, ("<｜tool▁calls▁begin｜>",)),
    "pythonic": CallFormat(_pythonic, _PYTHON_TAGS, "["),
}


def parser_for_template(source: str) -> str | None:
    """The tool-call format a chat template teaches its model, if it teaches one."""
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "tool▁calls▁begin" in source:
        return "deepseek"
    if "<|python_tag|>" in source or ('"parameters"' in source and "ipython" in source):
        return "llama3_json"
    return None


def parse(parser: str | CallFormat, text: str) -> tuple[str | None, list[ToolCall]]:
    """(the text before the calls, or None when there is none; the calls). Text with no
    call in the format is all content."""
    stream = ToolCallStream(PARSERS[parser] if isinstance(parser, str) else parser)
    content, _ = stream.feed(text)
    rest, _ = stream.finish()
    content += rest
    if not stream.calls:
        return content, []
    return (content if content.strip() else None), stream.calls


# -- required and named calls, by constrained decoding -----------------------------------------------

def _function(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str):
        raise LocalserveError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., ...}}")
    return function


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object"}
    if not isinstance(parameters, dict):
        raise LocalserveError(f"tool {function['name']!r}: parameters must be a JSON schema object")
    return parameters


def forced_format(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any],
                  parallel: bool) -> tuple[OutputFormat, str | None] | None:
    """For ``required`` or a named function: the JSON the output is held to, and the
    function name when the output is that function's arguments alone. None otherwise."""
    functions = [_function(tool) for tool in tools]
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise LocalserveError(f"tool_choice names {name!r}, which is not among the tools")
        return OutputFormat("json", _parameters(chosen[0])), name
    if tool_choice != "required":
        return None
    if not functions:
        raise LocalserveError("tool_choice 'required' needs tools")
    one_call = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": _parameters(f)},
                           "required": ["name", "arguments"], "additionalProperties": False} for f in functions]}
    schema = {"type": "array", "items": one_call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return OutputFormat("json", schema), None


def forced_call_format(name: str | None) -> CallFormat:
    """How an output held to ``forced_format`` is read: the named function's arguments,
    or a list of ``{"name", "arguments"}`` objects."""
    if name is not None:
        return CallFormat(lambda text, final: (0, [_Seen(name, text)] if text else []), (), "")
    return CallFormat(lambda text, final: (0, _call_objects(text, _skip(text, 0) + 1, final, ("arguments",), ","))
                      if text.lstrip().startswith("[") else (None, []), (), "")


class ToolCallStream:
    """Streams a reply's text as content while it cannot be a call, holds it from where
    one may begin (a partial marker included), and streams each call as OpenAI does: its
    id, type and name with empty arguments, then the arguments in pieces as they come."""

    def __init__(self, call_format: CallFormat) -> None:
        self.format = call_format
        self.text = ""
        self.shown = 0  # the length of the text sent as content
        self.holding = False
        self.calls: list[ToolCall] = []  # as far as they have been sent

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(the content to send now, the ``delta.tool_calls`` entries to send)."""
        self.text += text
        content = "" if self.holding else self._content()
        return content, self._pieces(final=False) if self.holding else []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The same, once the reply is complete: text that held no call is content."""
        pieces = self._pieces(final=True)
        if not self.calls:
            return self._show(len(self.text)), pieces
        start, _ = self.format.scan(self.text, True)
        return self._show(max(self.shown, start or 0)), pieces

    def _content(self) -> str:
        opener = self.format.opener
        if opener is not None and not self.text[:self.shown].strip():
            stripped = self.text.lstrip()
            if stripped.startswith(opener):
                self.holding = True
                return ""
            if not stripped:
                return ""  # leading whitespace: wait for the first character
        found = [at for marker in self.format.markers if (at := self.text.find(marker, self.shown)) >= 0]
        if found:
            self.holding = True
            return self._show(min(found))
        keep = max((partial_marker(self.text, marker) for marker in self.format.markers), default=0)
        return self._show(len(self.text) - keep)

    def _show(self, upto: int) -> str:
        out, self.shown = self.text[self.shown:upto], max(self.shown, upto)
        return out

    def _pieces(self, final: bool) -> list[dict[str, Any]]:
        _, seen = self.format.scan(self.text, final)
        pieces: list[dict[str, Any]] = []
        for index, call in enumerate(seen):
            if index == len(self.calls):
                self.calls.append(ToolCall(call.name, ""))
                pieces.append({"index": index, **self.calls[index].to_openai()})
            sent = self.calls[index]
            if len(call.arguments) > len(sent.arguments) and call.arguments.startswith(sent.arguments):
                pieces.append({"index": index, "function": {"arguments": call.arguments[len(sent.arguments):]}})
                sent.arguments = call.arguments
        return pieces
