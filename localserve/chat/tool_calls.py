"""Tool calls: read from a model's text in its family's format, and forced by constrained
decoding when the client requires them.

Formats (each family's documented output; the parser is chosen from the chat template):

- ``hermes`` (Hermes 2 Pro/3, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated;
- ``llama3_json`` (Llama 3.1-3.3): ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``, several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` per call;
- ``deepseek`` (DeepSeek-V3, R1): ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>name`` then the
  arguments in a ```` ```json ```` block, ``<｜tool▁call▁end｜>``, inside ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``;
- ``pythonic`` (Llama 3.2/4's pythonic mode): ``[name(key=value, ...), ...]``, read with
  ``ast`` (literals only; nothing is evaluated).

``tool_choice: "required"`` or a named function is enforced instead: the output is held to
a JSON schema (llguidance) whose arguments validate against the tool's parameters.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..engine.structured_output import OutputFormat
from ..errors import LocalserveError
from .reasoning import partial_marker


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object

    def to_openai(self, call_id: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: Any, arguments: Any) -> ToolCall | None:
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _json_values(text: str) -> list[Any] | None:
    """Every JSON value in ``text`` one after another (separated by whitespace or ``;``),
    or None if anything else is there."""
    decoder = json.JSONDecoder()
    values, at = [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        values.append(value)


def _calls_from_objects(objects: list[Any], arguments_key: str) -> list[ToolCall] | None:
    calls = []
    for item in objects:
        if not isinstance(item, dict):
            return None
        call = _call(item.get("name"), item.get(arguments_key, item.get("arguments")))
        if call is None:
            return None
        calls.append(call)
    return calls


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _hermes(text: str) -> tuple[str, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text[start:]):
        values = _json_values(body)
        found = _calls_from_objects(values, "arguments") if values else None
        if not found:
            return text, []
        calls += found
    return text[:start], calls


def _llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    body = text.split("<|python_tag|>", 1)
    prefix, rest = (body[0], body[1]) if len(body) == 2 else ("", text)
    if not rest.lstrip().startswith("{"):
        return text, []
    values = _json_values(rest)
    calls = _calls_from_objects(values, "parameters") if values else None
    return (prefix, calls) if calls else (text, [])


def _mistral(text: str) -> tuple[str, list[ToolCall]]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    parts = text[start:].split("[TOOL_CALLS]")[1:]
    calls: list[ToolCall] = []
    for part in parts:
        if "[ARGS]" in part:  # name[ARGS]{...}
            name, _, arguments = part.partition("[ARGS]")
            values = _json_values(arguments)
            call = _call(name.strip(), values[0]) if values and len(values) == 1 else None
            if call is None:
                return text, []
            calls.append(call)
        else:
            values = _json_values(part)
            found = _calls_from_objects(values[0], "arguments") if values and isinstance(values[0], list) \
                and len(values) == 1 else None
            if not found:
                return text, []
            calls += found
    return text[:start], calls


_DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>\s*(?:function)?\s*<｜tool▁sep｜>\s*([^\n]+?)\s*\n"
                            r"\s*```(?:json)?\s*\n(.*?)\n\s*```\s*<｜tool▁call▁end｜>", re.DOTALL)


def _deepseek(text: str) -> tuple[str, list[ToolCall]]:
    start = text.find("<｜tool▁calls▁begin｜>")
    if start < 0:
        return text, []
    calls = []
    for name, arguments in _DEEPSEEK_CALL.findall(text[start:]):
        values = _json_values(arguments)
        call = _call(name, values[0]) if values and len(values) == 1 else None
        if call is None:
            return text, []
        calls.append(call)
    return (text[:start], calls) if calls else (text, [])


def _pythonic(text: str) -> tuple[str, list[ToolCall]]:
    stripped = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not (stripped.startswith("[") and stripped.endswith("]")):
        return text, []
    try:
        tree = ast.parse(stripped, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return text, []
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return text, []
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return text, []
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return text, []
        try:
            calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
        except (TypeError, ValueError):  # a literal JSON cannot hold (a set, bytes)
            return text, []
    return "", calls


PARSERS = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral, "deepseek": _deepseek,
           "pythonic": _pythonic}


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


def parse(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(the text around the calls, or None when there is none; the calls). Text that does
    not hold well-formed calls in the format is all content, with no calls."""
    content, calls = PARSERS[parser](text)
    if not calls:
        return text, []
    return (content if content.strip() else None), calls


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


def forced_calls(text: str, name: str | None) -> list[ToolCall]:
    """The calls in an output held to ``forced_format`` (empty if it was cut short)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if name is not None:
        return [ToolCall(name, json.dumps(value, ensure_ascii=False))] if isinstance(value, dict) else []
    calls = [_call(item.get("name"), item.get("arguments")) for item in value if isinstance(item, dict)] \
        if isinstance(value, list) else []
    return [call for call in calls if call is not None]


# Where a call can begin, per format: text from there on is held until the output ends.
_STARTS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "deepseek": ("<｜tool▁calls▁begin｜>",),
           "llama3_json": ("<|python_tag|>",), "pythonic": ()}
# Formats whose calls are the whole output: a reply opening with this is held from its start.
_OPENERS = {"llama3_json": "{", "pythonic": "["}


class ToolCallStream:
    """Streams a reply's text while it cannot be a tool call, and holds it from where one
    may begin (a partial start marker included) until the end, when it is parsed."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.shown = ""  # sent as content
        self.held = ""
        self.holding = False

    def feed(self, text: str) -> str:
        """The content to send now."""
        self.held += text
        if self.holding:
            return ""
        opener = _OPENERS.get(self.parser)
        if opener and not self.shown.strip():
            stripped = self.held.lstrip()
            if stripped.startswith(opener):
                self.holding = True
                return ""
            if not stripped:
                return ""  # leading whitespace: wait for the first character
        for marker in _STARTS[self.parser]:
            at = self.held.find(marker)
            if at >= 0:
                self.holding = True
                return self._show(at)
        keep = max((partial_marker(self.held, marker) for marker in _STARTS[self.parser]), default=0)
        return self._show(len(self.held) - keep)

    def _show(self, upto: int) -> str:
        out, self.held = self.held[:upto], self.held[upto:]
        self.shown += out
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content still to send, the calls) once the reply is complete."""
        content, calls = parse(self.parser, self.shown + self.held)
        if not calls:
            return self._show(len(self.held)), []
        rest = (content or "")[len(self.shown):]
        return rest, calls
