"""One chat choice's reply as the API returns it: the thinking (``reasoning_content``), the
answer (``content``) and the tool calls, from the model's text, streamed or whole. The
streamed pieces add up to exactly the whole reply."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import reasoning, tool_calls
from .tool_calls import ToolCall


@dataclass(frozen=True, slots=True)
class ReplyFormat:
    opens_thinking: bool | None = None  # None: no <think> blocks; else whether the output starts in one
    tool_parser: str | None = None  # tool_choice auto: the model's own call format
    forced_tools: bool = False  # tool_choice required or named: the output is the calls' JSON
    forced_name: str | None = None  # the named function: the output is its arguments


@dataclass(slots=True)
class Reply:
    format: ReplyFormat
    splitter: reasoning.ReasoningSplitter | None = None
    calls_stream: tool_calls.ToolCallStream | None = None
    forced_text: list[str] = field(default_factory=list)
    saw_thinking: bool = False

    def __post_init__(self) -> None:
        if self.format.opens_thinking is not None:
            self.splitter = reasoning.ReasoningSplitter(inside=self.format.opens_thinking)
        if self.format.tool_parser is not None and not self.format.forced_tools:
            self.calls_stream = tool_calls.ToolCallStream(self.format.tool_parser)

    def feed(self, text: str) -> dict[str, str]:
        """The delta fields to send for this piece of text."""
        thinking, answer = self.splitter.feed(text) if self.splitter else ("", text)
        return self._delta(thinking, answer)

    def finish(self) -> tuple[dict[str, str], list[ToolCall]]:
        """The last delta fields and the tool calls, once the text is complete."""
        thinking, answer = self.splitter.finish() if self.splitter else ("", "")
        delta = self._delta(thinking, answer)
        calls: list[ToolCall] = []
        if self.format.forced_tools:
            text = "".join(self.forced_text)
            calls = tool_calls.forced_calls(text, self.format.forced_name)
            if not calls and text:  # cut short by max_tokens: the JSON as it stands
                delta["content"] = delta.get("content", "") + text
        elif self.calls_stream is not None:
            rest, calls = self.calls_stream.finish()
            if rest:
                delta["content"] = delta.get("content", "") + rest
        return delta, calls

    def _delta(self, thinking: str, answer: str) -> dict[str, str]:
        delta = {}
        if thinking:
            delta["reasoning_content"] = thinking
        if self.format.forced_tools:
            self.forced_text.append(answer)
            answer = ""
        elif self.calls_stream is not None:
            answer = self.calls_stream.feed(answer)
        if answer:
            delta["content"] = answer
        return delta

    @property
    def thought(self) -> bool:
        """Whether a think block was seen (or opened by the prompt)."""
        return self.splitter is not None and self.splitter.inside


def whole(reply_format: ReplyFormat, text: str) -> tuple[dict[str, Any], list[ToolCall]]:
    """The message fields (``content``, and ``reasoning_content`` for a thinking model)
    and the calls of a complete reply."""
    reply = Reply(reply_format)
    first = reply.feed(text)
    last, calls = reply.finish()
    content = first.get("content", "") + last.get("content", "")
    message: dict[str, Any] = {"content": content if content.strip() or not calls else None}
    if reply_format.opens_thinking is not None:
        thinking = first.get("reasoning_content", "") + last.get("reasoning_content", "")
        message["reasoning_content"] = thinking if reply.thought else None
    return message, calls
