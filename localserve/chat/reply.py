"""One chat choice's reply as the API returns it: the thinking (``reasoning_content``), the
answer (``content``) and the tool calls, from the model's text, streamed or whole. The
streamed pieces add up to exactly the whole reply."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine.output_format import OutputFormat
from ..text.chat_template import ChatTemplate
from . import reasoning, tool_calls
from .tool_calls import ToolCall


@dataclass(frozen=True, slots=True)
class ReplyFormat:
    opens_thinking: bool | None = None  # None: no <think> blocks; else whether the output starts in one
    tool_parser: str | None = None  # tool_choice auto: the model's own call format
    forced_tools: OutputFormat | None = None  # tool_choice required or named: the calls' JSON
    forced_name: str | None = None  # the named function: the output is its arguments

    def call_format(self) -> tool_calls.CallFormat | None:
        if self.forced_tools is not None:
            return tool_calls.forced_call_format(self.forced_name)
        return tool_calls.PARSERS[self.tool_parser] if self.tool_parser is not None else None


@dataclass(frozen=True, slots=True)
class AssistantMessage:
    """A whole reply: ``content`` is None when the reply only calls tools;
    ``reasoning_content`` is None for a model that does not think this way."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()

    def to_openai(self) -> dict[str, Any]:
        """As an OpenAI assistant message (to append to the conversation)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message


class Reply:
    """Reads one reply's text piece by piece into the delta fields to stream."""

    def __init__(self, reply_format: ReplyFormat) -> None:
        self.format = reply_format
        self.splitter = None if reply_format.opens_thinking is None else \
            reasoning.ReasoningSplitter(inside=reply_format.opens_thinking)
        call_format = reply_format.call_format()
        self.calls = None if call_format is None else tool_calls.ToolCallStream(call_format)

    def feed(self, text: str) -> dict[str, Any]:
        """The delta fields to send for this piece of text: ``reasoning_content``,
        ``content`` and ``tool_calls`` (OpenAI's entries) where there is something new."""
        thinking, answer = self.splitter.feed(text) if self.splitter else ("", text)
        return self._delta(thinking, *(self.calls.feed(answer) if self.calls else (answer, [])))

    def finish(self) -> dict[str, Any]:
        """The last delta fields, once the text is complete."""
        thinking, answer = self.splitter.finish() if self.splitter else ("", "")
        content, pieces = self.calls.feed(answer) if self.calls else (answer, [])
        if self.calls:
            rest, last_pieces = self.calls.finish()
            content, pieces = content + rest, pieces + last_pieces
        return self._delta(thinking, content, pieces)

    @staticmethod
    def _delta(thinking: str, content: str, pieces: list[dict[str, Any]]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if thinking:
            delta["reasoning_content"] = thinking
        if content:
            delta["content"] = content
        if pieces:
            delta["tool_calls"] = pieces
        return delta

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls read so far (whole once finished)."""
        return self.calls.calls if self.calls else []

    @property
    def thought(self) -> bool:
        """Whether a think block was seen (or opened by the prompt)."""
        return self.splitter is not None and self.splitter.inside


def reply_format(template: ChatTemplate, prompt: str, tools: list[dict[str, Any]] | None,
                 tool_choice: str | dict[str, Any] | None = None, parallel_tool_calls: bool = True,
                 tool_parser: str = "auto", reasoning_parser: str = "auto") -> ReplyFormat:
    """How a reply to ``prompt`` (rendered from ``template``) is read. ``tool_parser``: a
    format, ``auto`` (the template's) or ``none``; ``reasoning_parser``: ``think``,
    ``auto`` (when the template writes ``</think>``) or ``none``."""
    thinks = reasoning_parser == "think" or (reasoning_parser == "auto" and reasoning.thinks(template.source))
    forced = tool_calls.forced_format(tools, tool_choice, parallel_tool_calls) \
        if tools and tool_choice not in (None, "none", "auto") else None
    parser = None
    if tools and tool_choice in (None, "auto") and tool_parser != "none":
        parser = tool_calls.parser_for_template(template.source + (template.tool_use_source or "")) \
            if tool_parser == "auto" else tool_parser
    return ReplyFormat(reasoning.starts_inside(prompt) if thinks else None, parser,
                       forced[0] if forced else None, forced[1] if forced else None)


def sampling_fields(reply_format: ReplyFormat, encode: Callable[[str], list[int]],
                    max_reasoning_tokens: int | None = None) -> dict[str, Any]:
    """The SamplingParams fields a reply so read needs: the end of a think block the output
    begins in (or that a budget will close), special tokens kept for a call parser."""
    fields: dict[str, Any] = {}
    if reply_format.opens_thinking is not None and (reply_format.opens_thinking or max_reasoning_tokens is not None):
        fields.update(thinking_end=reasoning.end_tokens(encode), thinking_budget=max_reasoning_tokens)
    if reply_format.tool_parser is not None:
        fields["skip_special_tokens"] = False  # the call markers are special tokens in some vocabularies
    return fields


def whole(reply_format: ReplyFormat, text: str) -> AssistantMessage:
    """A complete reply read at once."""
    reply = Reply(reply_format)
    first, last = reply.feed(text), reply.finish()
    content = first.get("content", "") + last.get("content", "")
    thinking = None
    if reply_format.opens_thinking is not None and reply.thought:
        thinking = first.get("reasoning_content", "") + last.get("reasoning_content", "")
    calls = tuple(reply.tool_calls)
    return AssistantMessage(content if content.strip() or not calls else None, thinking, calls)
