"""OpenAI's endpoints: /v1/models, /v1/chat/completions, /v1/completions, and vLLM's
/tokenize and /detokenize. Streams are server-sent events, one per generated chunk,
ending with ``data: [DONE]``.

What other APIs that take chat messages share (anthropic_api.py): ``ChatPrompt`` renders
a chat request and says how its reply is read, ``generate`` runs it and answers whole or
as a stream framed by an ``EventFormat``."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.async_engine import EngineDeadError, RequestStream
from ..engine.outputs import RequestOutput
from ..engine.outputs import TokenLogprobs
from ..errors import LocalserveError
from ..vision.image_input import ImageInput
from ..vision.placement import images_for, lay_out
from ..chat import reply as chat_reply
from ..chat.messages import image_sources, render_messages
from ..chat.reply import ReplyFormat
from . import generation as gen
from .config import ServerConfig
from .model_manager import LoadedModel, parse_keep_alive
from .protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest, ImageURLPart,
                       NamedToolChoice, TokenizeRequest)
from .state import state_of

router = APIRouter()


_MAX_WAIT_S = 86400.0


def _wait_seconds(request: Request) -> float | None:
    """``Prefer: wait=N`` (RFC 7240): answer within N seconds, so a model still loading
    gets a 503 with Retry-After instead of a wait. Absent: wait for the load. A preference
    may be honoured in part: N is taken between 0 and a day."""
    for part in request.headers.get("prefer", "").split(","):
        name, _, value = part.strip().partition("=")
        if name.strip().lower() == "wait":
            try:
                seconds = float(value)
            except ValueError:
                raise LocalserveError(f"Prefer: wait={value!r} is not a number of seconds") from None
            return min(max(0.0, seconds), _MAX_WAIT_S) if not math.isnan(seconds) else 0.0
    return None


async def acquire(request: Request, name: str) -> LoadedModel:
    return await state_of(request).manager.acquire(name, _wait_seconds(request))


# -- models -----------------------------------------------------------------------------

def _model_card(request: Request, name: str) -> dict[str, Any]:
    manager = state_of(request).manager
    entry = manager.catalog.find(name)
    model = manager.loaded.get(entry.name)
    card: dict[str, Any] = {"id": entry.name, "object": "model", "owned_by": "localserve",
                            "created": int(model.loaded_at if model else entry.created)}
    if model is not None:
        card["max_model_len"] = model.max_model_len
    return card


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(request, name) for name in state_of(request).manager.names()]}


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> dict[str, Any]:
    return _model_card(request, model_id)  # 404 when unknown


# -- chat completions ---------------------------------------------------------------------

def _render_chat(model: LoadedModel, messages: list[ChatMessage], add_generation_prompt: bool,
                 continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                 variables: dict[str, Any] | None = None) -> tuple[str, list[ImageInput]]:
    """The prompt text, the model's own system prompt and opening turns before the
    messages, each image laid out where the template put its marker; and the messages'
    images. ``variables``: further template variables (``enable_thinking``, ...)."""
    model.check_prompt_chars(sum(len(m.text() or "") for m in messages))
    images = images_for(model.images, image_sources([m.plain() for m in messages]), model.name)
    template = model.chat_template()
    conversation = model.settings.conversation([m.plain() for m in messages])
    text = render_messages(conversation, lambda plain, **how: template.render(
        plain, add_generation_prompt=add_generation_prompt, tools=tools, **(variables or {}), **how))
    if continue_final_message:
        # The reply continues the final assistant message: drop what the template
        # appends after its content (end-of-turn tokens).
        final = messages[-1].text() or ""
        end = text.rfind(final)
        if end >= 0:
            text = text[: end + len(final)]
    return lay_out(model.images, text, images), images


class ChatPrompt:
    """A chat request made ready for one model: ``ids`` renders it with the model's template
    and works out how the reply is read (``reply_format``: thinking, tool calls) and the
    SamplingParams fields that reading needs (``sampling``). Every endpoint that takes chat
    messages goes through here, so that they render and read replies alike."""

    def __init__(self, body: ChatCompletionRequest, config: ServerConfig) -> None:
        self.body, self.config = body, config
        self.reply_format = ReplyFormat()
        self.sampling: dict[str, Any] = {}  # filled in by ids()
        self.images: list[ImageInput] = []  # the messages' images, in prompt order: filled in by ids()

    def ids(self, model: LoadedModel) -> list[int]:
        body = self.body
        text, self.images = _render_chat(model, body.messages, body.add_generation_prompt,
                                         body.continue_final_message, body.tools, body.template_variables())
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
        self.reply_format = chat_reply.reply_format(model.chat_template(), text, body.tools, choice,
                                                    body.parallel_tool_calls, self.config.tool_parser,
                                                    self.config.reasoning_parser)
        encode = functools.partial(model.encode, add_special_tokens=False)
        self.sampling.update(chat_reply.sampling_fields(self.reply_format, encode, body.max_reasoning_tokens))
        # The template writes BOS itself where the model wants it.
        return encode(text)

    def prompts(self, model: LoadedModel) -> list[list[int]]:
        return [self.ids(model)]


async def fetch_image_urls(messages: list[ChatMessage], config: ServerConfig) -> None:
    """The messages' http(s) image URLs replaced by the images, fetched, when the operator
    allows it (vision/image_fetch.py); otherwise left for the image path to refuse."""
    if config.image_fetcher is None:
        return
    parts = [part for message in messages if isinstance(message.content, list) for part in message.content
             if isinstance(part, ImageURLPart) and part.image_url.url.lstrip()[:8].lower().startswith(("http://",
                                                                                                       "https://"))]
    fetched = await asyncio.gather(*(config.image_fetcher.data_url(part.image_url.url.strip()) for part in parts))
    for part, url in zip(parts, fetched):
        part.image_url.url = url


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    await fetch_image_urls(body.messages, state_of(request).config)
    prompt = ChatPrompt(body, state_of(request).config)
    return await generate(request, body, prompt.prompts,
                          lambda model, choices: _ChatShaper(model, body, choices, prompt.reply_format),
                          prompt.sampling, images=lambda: prompt.images)


class Shaper(Protocol):
    """Makes an endpoint's answers from its choices' outputs."""

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The whole body, from each choice's final output."""
        ...

    def chunks(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict]:
        """The stream's events, from (choice index, output) as they come."""
        ...


def _sse_frame(data: dict, name: str | None) -> bytes:
    head = f"event: {name}\n".encode() if name is not None else b""
    return head + b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


@dataclass(frozen=True, slots=True)
class EventFormat:
    """How a stream frames its events. ``name``: an event's ``event:`` line (None: none);
    ``error``: the event an error mid-stream is sent as, from its message and whether it
    is the server's fault; ``end``: what follows the last event; ``frame``: an event's
    bytes from its data and name (server-sent events unless given: Ollama's are NDJSON)."""

    name: Callable[[dict], str | None]
    error: Callable[[str, bool], dict]
    end: bytes
    frame: Callable[[dict, str | None], bytes] = _sse_frame
    media_type: str = "text/event-stream"


# OpenAI's: data lines only, an error as its error object, then data: [DONE]
OPENAI_EVENTS = EventFormat(
    name=lambda data: None,
    error=lambda message, server: {"error": {"message": message,
                                             "type": "server_error" if server else "invalid_request_error",
                                             "param": None, "code": None}},
    end=b"data: [DONE]\n\n")


async def generate(request: Request, body: ChatCompletionRequest | CompletionRequest,
                   prompts: Callable[[LoadedModel], list[list[int]]],
                   shaper: Callable[[LoadedModel, list[gen.Choice]], Shaper],
                   extra: dict[str, Any] | None = None, events: EventFormat = OPENAI_EVENTS,
                   defaults: Mapping[str, Any] | None = None,
                   images: Callable[[], Sequence[ImageInput]] = lambda: ()) -> Response:
    """Acquire the model, run every choice, answer as one body or a stream of events;
    the model is released when the response ends, however it ends. ``extra``: SamplingParams
    fields ``prompts`` works out as it renders (filled in by the time it returns);
    ``defaults``: the API's own request-field defaults, under the model's; ``images``: the
    images the prompts lay out, once ``prompts`` has run."""
    keep_alive = parse_keep_alive(body.keep_alive)
    state = state_of(request)
    model = await acquire(request, body.model)
    released = False
    try:
        if model.embeds:
            raise LocalserveError(f"{model.name!r} is an embedding model: it answers /v1/embeddings and /api/embed, "
                                  "not requests for text")
        # Rendering and tokenizing take time in proportion to the prompt: off the event loop.
        ids = await asyncio.to_thread(prompts, model)
        choices = gen.choices_for(body, ids, model.max_model_len, {**(defaults or {}), **model.settings.request_fields()},
                                  images(), **(extra or {}))
        streams = await gen.start(model, choices)
        progress = [gen.Progress(state.metrics, model.name) for _ in streams]
        shape = shaper(model, choices)
        if body.stream:
            released = True  # by the stream, when it ends
            return _sse(shape.chunks(gen.merged(streams, progress)), streams,
                        lambda: state.manager.release(model, keep_alive), events)
        return JSONResponse(shape.response(await gen.final_outputs(request, streams, progress)))
    except gen.ClientGone:
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
    finally:
        if not released:
            state.manager.release(model, keep_alive)


def _chat_logprobs(model: LoadedModel, logprobs: list[TokenLogprobs]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text, data = gen.token_text(model.tokenizer, token_id)
        return {"token": text, "logprob": gen.clamp(logprob), "bytes": data}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _Shaper:
    """What both endpoints' bodies and stream chunks share."""

    chunk_object: str
    id_prefix: str

    def __init__(self, model: LoadedModel, body: ChatCompletionRequest | CompletionRequest,
                 choices: list[gen.Choice]) -> None:
        self.model, self.choices = model, choices
        self.response_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_name = body.model
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        data: dict[str, Any] = {"id": self.response_id, "object": self.chunk_object, "created": self.created,
                                "model": self.model_name, "choices": choices}
        if self.include_usage:
            data["usage"] = usage  # null on every chunk but the last, as OpenAI sends
        return data


class _ChatShaper(_Shaper):
    """Builds /v1/chat/completions bodies and stream chunks."""

    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, model: LoadedModel, body: ChatCompletionRequest, choices: list[gen.Choice],
                 reply_format: ReplyFormat) -> None:
        super().__init__(model, body, choices)
        self.body = body
        self.reply_format = reply_format

    def choice(self, choice: gen.Choice, output: RequestOutput) -> dict[str, Any]:
        reply = chat_reply.whole(self.reply_format, output.text)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if self.reply_format.opens_thinking is not None:
            message["reasoning_content"] = reply.reasoning_content
        if reply.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in reply.tool_calls]
        return {"index": choice.index, "message": message, "logprobs": self.logprobs(output.logprobs or []),
                "finish_reason": _finish_reason(output, bool(reply.tool_calls))}

    def logprobs(self, logprobs: list[TokenLogprobs]) -> dict[str, Any] | None:
        return _chat_logprobs(self.model, logprobs) if self.body.logprobs else None

    def usage(self, outputs: list[RequestOutput]) -> dict[str, int]:
        return _usage(len(self.choices[0].prompt_ids), sum(len(o.token_ids) for o in outputs))

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        return {
            "id": self.response_id, "object": "chat.completion", "created": self.created, "model": self.model_name,
            "choices": [self.choice(choice, output) for choice, output in zip(self.choices, outputs)],
            "usage": self.usage(outputs),
        }

    async def chunks(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict]:
        for choice in self.choices:
            yield self.chunk([{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}])
        sent = [_Sent() for _ in self.choices]
        replies = [chat_reply.Reply(self.reply_format) for _ in self.choices]
        finals: list[RequestOutput] = []
        async for index, output in outputs:
            choice, reply = self.choices[index], replies[index]
            new_logprobs = sent[index].advance(output)
            delta = reply.feed(output.delta)
            if output.finished:
                finals.append(output)
                for key, value in reply.finish().items():
                    delta[key] = delta.get(key, type(value)()) + value
            # Calls go one entry a chunk, after the text, as OpenAI streams them.
            pieces = delta.pop("tool_calls", [])
            finish_reason = _finish_reason(output, bool(reply.tool_calls)) if output.finished else None
            if delta or new_logprobs or (finish_reason and not pieces):
                yield self.chunk([{"index": choice.index, "delta": delta, "logprobs": self.logprobs(new_logprobs),
                                   "finish_reason": None if pieces else finish_reason}])
            for piece in pieces:
                yield self.chunk([{"index": choice.index, "delta": {"tool_calls": [piece]}, "logprobs": None,
                                   "finish_reason": None}])
            if finish_reason and pieces:
                yield self.chunk([{"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}])
        if self.include_usage:
            yield self.chunk([], self.usage(finals))


def _finish_reason(output: RequestOutput, called: bool) -> str | None:
    """``tool_calls`` when the reply ended on calls, as OpenAI reports it."""
    return "tool_calls" if called and output.finish_reason == "stop" else output.finish_reason


class _Sent:
    """How many of one choice's tokens a stream has sent (the text to send is each
    output's delta)."""

    __slots__ = ("tokens",)

    def __init__(self) -> None:
        self.tokens = 0

    def advance(self, output: RequestOutput) -> list[TokenLogprobs]:
        """The logprobs not sent yet."""
        logprobs = gen.entries(output.logprobs, self.tokens)
        self.tokens = len(output.token_ids)
        return logprobs


class _EventStream(StreamingResponse):
    """Events framed by ``events``. However the response ends (completed,
    client gone before or during the stream), ``on_close`` runs once: it aborts what is
    unfinished and releases the model."""

    def __init__(self, chunks: AsyncIterator[dict], on_close: Callable[[], None], events: EventFormat) -> None:
        super().__init__(self._events(chunks, events), media_type=events.media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    @staticmethod
    async def _events(chunks: AsyncIterator[dict], events: EventFormat) -> AsyncIterator[bytes]:
        try:
            async for data in chunks:
                yield events.frame(data, events.name(data))
        except (LocalserveError, EngineDeadError) as exc:
            # Headers are out: report in-band, as OpenAI's and Anthropic's servers do mid-stream.
            # An engine that ended the request (unloaded, the drain timed out, failed) is the server's.
            error = events.error(str(exc), isinstance(exc, EngineDeadError))
            yield events.frame(error, events.name(error))
        yield events.end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(chunks: AsyncIterator[dict], streams: list[RequestStream], release: Callable[[], None],
         events: EventFormat) -> _EventStream:
    def on_close() -> None:
        for stream in streams:
            stream.close()
        release()

    return _EventStream(chunks, on_close, events)


# -- text completions ---------------------------------------------------------------------

@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest) -> Response:
    if body.suffix is not None:
        raise LocalserveError("suffix is not supported")
    texts = [p if isinstance(p, str) else None for p in body.prompts()]

    def prompts(model: LoadedModel) -> list[list[int]]:
        return [model.encode(p) if isinstance(p, str) else list(p) for p in body.prompts()]

    return await generate(request, body, prompts,
                          lambda model, choices: _CompletionShaper(model, body, choices, texts))


class _CompletionShaper(_Shaper):
    """Builds /v1/completions bodies and stream chunks: echo and OpenAI's legacy logprobs."""

    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: LoadedModel, body: CompletionRequest, choices: list[gen.Choice],
                 texts: list[str | None]) -> None:
        super().__init__(model, body, choices)
        self.body, self.texts = body, texts

    def prompt_text(self, choice: gen.Choice) -> str:
        text = self.texts[choice.prompt_index]
        return text if text is not None else self.model.decode(choice.prompt_ids)

    def logprobs(self, choice: gen.Choice, output: RequestOutput, start: int, offset: int,
                 with_prompt: bool) -> dict[str, Any] | None:
        """Legacy logprobs of output tokens from ``start`` (and of the prompt when echoing),
        text offsets counted from ``offset``."""
        if self.body.logprobs is None:
            return None
        rows: list[tuple[int, float | None, list[tuple[int, float]] | None]] = []
        if with_prompt:
            rows.append((choice.prompt_ids[0], None, None))
            rows += [(lp.token_id, lp.logprob, lp.top) for lp in output.prompt_logprobs or []]
        rows += [(lp.token_id, lp.logprob, lp.top) for lp in gen.entries(output.logprobs, start)]
        tokens, offsets = [], []
        for token_id, _, _ in rows:
            text, _ = gen.token_text(self.model.tokenizer, token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else gen.clamp(lp) for _, lp, _ in rows],
            "top_logprobs": [None if top is None else
                             {gen.token_text(self.model.tokenizer, t)[0]: gen.clamp(v) for t, v in top}
                             for _, _, top in rows],
            "text_offset": offsets,
        }

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for choice, output in zip(self.choices, outputs):
            prefix = self.prompt_text(choice) if self.body.echo else ""
            choices.append({"index": choice.index, "text": prefix + output.text,
                            "logprobs": self.logprobs(choice, output, 0, 0, self.body.echo),
                            "finish_reason": output.finish_reason})
        return {**self.chunk(choices), "usage": self.usage(outputs)}

    def usage(self, outputs: list[RequestOutput]) -> dict[str, int]:
        prompt_tokens = sum(len(self.choices[p * self.body.n].prompt_ids) for p in range(len(self.texts)))
        return _usage(prompt_tokens, sum(len(o.token_ids) for o in outputs))

    async def chunks(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict]:
        sent = [_Sent() for _ in self.choices]
        echo_pending = [self.body.echo for _ in self.choices]  # the first chunk carries the prompt
        token_chars = [0 for _ in self.choices]  # text_offset of the next token
        finals: list[RequestOutput] = []
        async for index, output in outputs:
            choice = self.choices[index]
            start = sent[index].tokens
            text, new_logprobs = output.delta, sent[index].advance(output)
            with_prompt = echo_pending[index]
            if with_prompt:
                text = self.prompt_text(choice) + text
                echo_pending[index] = False
            if output.finished:
                finals.append(output)
            if not (text or output.finished or new_logprobs):
                continue
            logprobs = self.logprobs(choice, output, start, token_chars[index], with_prompt)
            if logprobs and logprobs["tokens"]:
                token_chars[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            yield self.chunk([{"index": choice.index, "text": text, "logprobs": logprobs,
                               "finish_reason": output.finish_reason if output.finished else None}])
        if self.include_usage:
            yield self.chunk([], self.usage(finals))


# -- tokenize / detokenize ------------------------------------------------------------------

@router.post("/tokenize")
async def tokenize(request: Request, body: TokenizeRequest) -> dict[str, Any]:
    model = await acquire(request, body.model)
    try:
        if body.messages is not None:
            await fetch_image_urls(body.messages, state_of(request).config)
            text, _ = await asyncio.to_thread(_render_chat, model, body.messages, body.add_generation_prompt)
            tokens = model.encode(text, add_special_tokens=False)  # an image's tokens counted as the model reads them
        else:
            tokens = await asyncio.to_thread(model.encode, body.prompt or "", body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": model.max_model_len, "tokens": tokens}
    finally:
        state_of(request).manager.release(model)


@router.post("/detokenize")
async def detokenize(request: Request, body: DetokenizeRequest) -> dict[str, Any]:
    model = await acquire(request, body.model)
    try:
        if any(token >= model.vocab_size for token in body.tokens):
            raise LocalserveError(f"token ids must be in [0, {model.vocab_size})")
        return {"prompt": await asyncio.to_thread(model.decode, body.tokens)}
    finally:
        state_of(request).manager.release(model)

