"""What a structured output must match (``OutputFormat``), as requests carry it: plain data
and no torch, so the HTTP side builds it and a request can cross to an engine process.
``structured_output.py`` turns it into masks."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import LocalserveError

# Python's json.dumps layout: predictable, and no room for runaway whitespace.
_JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]

# The largest schema, regex, choice list or grammar a request may send (characters of its
# text or JSON): real ones are a few KB, big tool schemas tens of KB. Compiling grows with
# it and blocks the engine's step; a grammar of 100,000 alternatives panicked llguidance.
MAX_FORMAT_CHARS = 256 << 10


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """What the output must match: a JSON schema (``json``, a dict), any JSON object,
    a regular expression, one of the ``choice`` strings, or a grammar in Lark or GBNF."""

    kind: Kind
    value: Any = None

    def grammar(self) -> str:
        """The llguidance grammar; raises LocalserveError when it cannot be formed."""
        import llguidance
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            size = sum(map(len, self.value)) if self.kind == "choice" else len(
                self.value if isinstance(self.value, str) else json.dumps(self.value))
        except (TypeError, ValueError, RecursionError):
            raise LocalserveError(f"the {self.kind} for structured output is not plain JSON data") from None
        if size > MAX_FORMAT_CHARS:
            raise LocalserveError(f"the {self.kind} for structured output is {size:,} characters, over the limit of "
                                  f"{MAX_FORMAT_CHARS:,}")
        try:
            if self.kind == "json":
                return llguidance.LLMatcher.grammar_from_json_schema(self.value, defaults=_JSON_OPTIONS)
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.value)
            if self.kind == "choice":
                return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in self.value))
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(self.value))
        except Exception as exc:  # noqa: BLE001  # the GBNF converter raises bare Exceptions on bad text
            raise LocalserveError(f"invalid {self.kind} for structured output: {first_line(str(exc))}") from exc

    def describe(self) -> str:
        text = self.value if isinstance(self.value, str) else json.dumps(self.value)
        return f"{self.kind} {text[:60]}"


def first_line(message: str) -> str:
    """A grammar engine's error as one line: a Rust panic comes with its backtrace."""
    line = next((line.strip() for line in message.splitlines() if line.strip()), "unknown error")
    return line if len(line) <= 300 else line[:300] + "..."
