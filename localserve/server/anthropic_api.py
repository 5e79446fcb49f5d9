"""Anthropic's Messages API: POST /v1/messages, whole or streamed as Anthropic's named
events, and POST /v1/messages/count_tokens, answered as Anthropic documents them so that
the anthropic SDK works unchanged. A request is made into the OpenAI chat request it
amounts to (anthropic_protocol.py) and rendered, run and read by the code that serves
/v1/chat/completions (openai_api.ChatPrompt and generate); only the answer's shape is
Anthropic's. Errors on these routes come in Anthropic's shape too (errors.py, guard.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pydantic_core
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..chat import reply as chat_reply
from ..chat.reply import ReplyFormat
from ..engine.outputs import RequestOutput
from . import generation as gen
from .anthropic_protocol import CountTokensRequest, MessagesRequest, error_body
from .model_manager import LoadedModel
from .openai_api import ChatPrompt, EventFormat, acquire, fetch_image_urls, generate
from .state import state_of


router = APIRouter()

# Anthropic's stream: each event named by its type; an error is an ``error`` event; no end marker
ANTHROPIC_EVENTS = EventFormat(
    name=lambda data: data["type"],
    error=lambda message, server: error_body(500 if server else 400, message),
    end=b"")


@router.post("/v1/messages")
async def messages(request: Request, body: MessagesRequest) -> Response:
    chat = body.chat_request()
    await fetch_image_urls(chat.messages, state_of(request).config)
    prompt = ChatPrompt(chat, state_of(request).config)

    def prompts(model: LoadedModel) -> list[list[int]]:
        ids = prompt.ids(model)
        # Anthropic's clients ask for more than a local model's context may leave room for
        # (agent tools ask for tens of thousands). As Anthropic's newer models do, the reply then stops
        # when the context is full (stop_reason model_context_window_exceeded), not a 400.
        room = model.max_model_len - len(ids)
        if 0 < room < body.max_tokens:
            prompt.sampling["max_tokens"] = room
        return [ids]

    return await generate(request, chat, prompts,
                          lambda model, choices: _MessageShaper(body, choices[0], prompt.reply_format),
                          prompt.sampling, events=ANTHROPIC_EVENTS, images=lambda: prompt.images)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, body: CountTokensRequest) -> dict[str, int]:
    chat = body.chat_request()
    await fetch_image_urls(chat.messages, state_of(request).config)
    prompt = ChatPrompt(chat, state_of(request).config)
    model = await acquire(request, body.model)
    try:
        return {"input_tokens": len(await asyncio.to_thread(prompt.ids, model))}
    finally:
        state_of(request).manager.release(model)


class _Blocks:
    """Turns a reply's delta fields (chat.reply.Reply's: thinking, text, tool call pieces)
    into Anthropic's content block events, one block open at a time. Text that is only
    whitespace waits for more before it opens a block: before tool calls it is dropped, as
    a whole reply drops it (chat.reply.whole)."""

    def __init__(self) -> None:
        self.index = -1  # the open block's
        self.open: str | None = None  # its type
        self.spaces = ""  # whitespace not in a block yet

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if thinking := delta.get("reasoning_content"):
            if self.open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": thinking}))
        if text := delta.get("content"):
            events += self._text(text)
        for piece in delta.get("tool_calls", []):
            if "id" in piece:  # a call's head: its id and name, then its arguments in pieces
                events += self._start({"type": "tool_use", "id": _tool_use_id(piece["id"]),
                                       "name": piece["function"]["name"], "input": {}})
            if arguments := piece["function"].get("arguments"):
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def close(self, called: bool) -> list[dict[str, Any]]:
        """The last events once the reply is complete (``called``: it holds tool calls)."""
        events = [] if called or not self.spaces else self._text("", flush=True)
        if self.open is not None:
            events.append({"type": "content_block_stop", "index": self.index})
            self.open = None
        return events

    def _text(self, text: str, flush: bool = False) -> list[dict[str, Any]]:
        if self.open == "text":
            return [self._delta({"type": "text_delta", "text": text})]
        text, self.spaces = self.spaces + text, ""
        if not (text.strip() or flush):
            self.spaces = text
            return []
        return [*self._start({"type": "text", "text": ""}), self._delta({"type": "text_delta", "text": text})]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = [{"type": "content_block_stop", "index": self.index}] if self.open is not None else []
        self.index += 1
        self.open = block["type"]
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _content(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content blocks a stream's events add up to (a tool_use's input: the object its
    JSON pieces hold, as far as they go when max_tokens cut the call short)."""
    blocks: list[dict[str, Any]] = []
    arguments: dict[int, str] = {}
    for event in events:
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "input_json_delta":
                arguments[event["index"]] = arguments.get(event["index"], "") + delta["partial_json"]
            else:
                field = "text" if delta["type"] == "text_delta" else "thinking"
                block[field] += delta[field]
    for index, text in arguments.items():
        blocks[index]["input"] = object_so_far(text)
    return blocks


def object_so_far(text: str) -> dict[str, Any]:
    """The object a call's arguments hold as far as their text goes (a call cut short by
    max_tokens: Anthropic's ``input`` is an object, never text). pydantic's JSON reader in
    partial mode, the reader the anthropic SDK uses for a stream's ``partial_json``: whole
    members are kept, an unfinished one is left out, open containers are closed."""
    try:
        value = pydantic_core.from_json(text, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(output: RequestOutput, called: bool, max_tokens: int) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence. A reply that ends on tool calls is
    ``tool_use``, as the OpenAI endpoint's is ``tool_calls``."""
    if output.finish_reason == "length":
        full = len(output.token_ids) < max_tokens  # the context ran out first
        return ("model_context_window_exceeded" if full else "max_tokens"), None
    if called:
        return "tool_use", None
    if output.stop_string is not None:
        return "stop_sequence", output.stop_string
    return "end_turn", None


class _MessageShaper:
    """Builds /v1/messages bodies and stream events for one reply. Both read the text
    through the same Reply and _Blocks, so a stream's events add up to the whole body."""

    def __init__(self, body: MessagesRequest, choice: gen.Choice, reply_format: ReplyFormat) -> None:
        self.model_name, self.max_tokens = body.model, body.max_tokens
        self.choice, self.reply_format = choice, reply_format
        self.message_id = f"msg_{uuid.uuid4().hex}"

    def message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                output_tokens: int) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model_name,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": {"input_tokens": len(self.choice.prompt_ids), "output_tokens": output_tokens}}

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        [output] = outputs
        reply, blocks = chat_reply.Reply(self.reply_format), _Blocks()
        events = blocks.feed(reply.feed(output.text)) + blocks.feed(reply.finish())
        called = bool(reply.tool_calls)
        return self.message(_content(events + blocks.close(called)), _stop(output, called, self.max_tokens),
                            len(output.token_ids))

    async def chunks(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict]:
        yield {"type": "message_start", "message": self.message([], (None, None), 0)}
        reply, blocks = chat_reply.Reply(self.reply_format), _Blocks()
        async for _, output in outputs:
            for event in blocks.feed(reply.feed(output.delta)):
                yield event
            if output.finished:
                called = bool(reply.tool_calls)
                for event in blocks.feed(reply.finish()) + blocks.close(called):
                    yield event
                stop_reason, stop_sequence = _stop(output, called, self.max_tokens)
                yield {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                       "usage": {"output_tokens": len(output.token_ids)}}
                yield {"type": "message_stop"}
