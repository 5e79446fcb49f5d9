"""Ollama's generation and embedding routes, ``/api/chat``, ``/api/generate``,
``/api/embed`` and ``/api/embeddings``, shaped as Ollama documents them. Generation: NDJSON streams (on by default) of ``{"model", "created_at", "message" |
"response", "done"}`` objects, the last with ``done_reason`` and the timing and count
fields; ``thinking`` split from the answer for thinking models; tool calls with their
arguments as objects.

A request is translated into the OpenAI chat request it means and run through the same
path (openai_api.ChatPrompt and generate), so the two APIs render prompts, sample, and
read thinking and tool calls alike. Ollama's ``options`` map onto the sampling fields;
its defaults (temperature 0.8, top_k 40, top_p 0.9) apply where neither a request nor
the model's own parameters (a Modelfile's) give them.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ..chat import reply as chat_reply
from ..engine.outputs import RequestOutput
from ..engine.sampling_params import PoolingParams
from ..errors import LocalserveError
from ..registry.settings import request_fields
from . import embeddings
from . import generation as gen
from .model_manager import LoadedModel, parse_keep_alive
from .ollama_protocol import ChatBody, EmbedBody, EmbeddingsBody, GenerateBody, Options
from .openai_api import ChatPrompt, EventFormat, generate
from .protocol import ChatCompletionRequest
from .state import state_of

router = APIRouter()

# Ollama's defaults for what a request's options and the model's parameters leave out
# (llama.cpp's sampler defaults), as request fields. Its repeat_penalty of 1.1 over the
# last 64 tokens is left off: this server's repetition penalty covers the whole context,
# which would penalise far more.
DEFAULT_OPTIONS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}


def _ndjson_frame(data: dict[str, Any], _: str | None) -> bytes:
    return json.dumps(data, ensure_ascii=False).encode() + b"\n"


OLLAMA_EVENTS = EventFormat(name=lambda data: None, error=lambda message, server: {"error": message}, end=b"",
                            frame=_ndjson_frame, media_type="application/x-ndjson")


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _templated(model: LoadedModel) -> bool:
    try:
        model.chat_template()
        return True
    except LocalserveError:
        return False  # Ollama's "{{ .Prompt }}": the prompt as it is


def sampling_fields(options: Options | None) -> dict[str, Any]:
    """Ollama's options as OpenAI request fields (with vLLM's extra sampling fields)."""
    return request_fields(options.model_dump(exclude_none=True) if options is not None else {})


def _format_fields(format: str | dict[str, Any] | None) -> dict[str, Any]:
    if format == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(format, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": format}}}
    return {}


def _think_fields(think: bool | str | None) -> dict[str, Any]:
    if isinstance(think, bool):
        return {"chat_template_kwargs": {"enable_thinking": think}}
    if isinstance(think, str):
        return {"reasoning_effort": think}
    return {}


def _message(message: dict[str, Any]) -> dict[str, Any]:
    """An Ollama chat message as OpenAI's: arguments objects as they are (the templates
    want objects), a tool result's ``tool_name`` as its ``name``, its ``images`` kept (laid out
    before its text)."""
    plain: dict[str, Any] = {"role": message.get("role"), "content": message.get("content") or ""}
    if message.get("images"):
        plain["images"] = message["images"]
    if message.get("tool_calls"):
        plain["tool_calls"] = [{"id": call.get("id") or f"call_{i}", "type": "function",
                                "function": {"name": (call.get("function") or {}).get("name"),
                                             "arguments": json.dumps((call.get("function") or {}).get("arguments", {}))}}
                               for i, call in enumerate(message["tool_calls"])]
    if message.get("tool_name"):
        plain["name"] = message["tool_name"]
    return plain


def _chat_request(model: str, messages: list[dict[str, Any]], body: ChatBody | GenerateBody,
                  tools: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
    """The OpenAI chat request an Ollama request means (validated as one: a bad field is a
    400 naming it)."""
    fields = {"model": model, "messages": messages, "stream": body.stream, "keep_alive": body.keep_alive,
              **sampling_fields(body.options), **_format_fields(body.format), **_think_fields(body.think)}
    if tools:
        fields["tools"] = tools
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise LocalserveError(f"{'.'.join(str(part) for part in first['loc'])}: {first['msg']}") from None


def _ns(seconds: float) -> int:
    return int(max(0.0, seconds) * 1e9)


class _LoadTimer:
    """Ollama's ``load_duration``: for a request that waited for its model to load, from
    its arrival to the model in hand; 0 when the model was loaded already. The route's
    prompt callback runs right after the model is acquired, so wrapping it reads the
    clock there."""

    def __init__(self) -> None:
        self.started = time.time()  # the wall clock, as LoadedModel.loaded_at
        self.seconds = 0.0

    def around(self, prompts: Callable[[LoadedModel], list[list[int]]]) -> Callable[[LoadedModel], list[list[int]]]:
        def timed(model: LoadedModel) -> list[list[int]]:
            self.seconds = model.load_wait(self.started)
            return prompts(model)

        return timed


def _timings(output: RequestOutput, load_seconds: float) -> dict[str, int]:
    def ns(start: float | None, end: float | None) -> int:
        return _ns(end - start) if start is not None and end is not None else 0

    return {"total_duration": _ns(load_seconds) + ns(output.arrival_time, output.finish_time),
            "load_duration": _ns(load_seconds),
            "prompt_eval_count": len(output.prompt_token_ids),
            "prompt_eval_duration": ns(output.first_scheduled_time, output.first_token_time),
            "eval_count": len(output.token_ids), "eval_duration": ns(output.first_token_time, output.finish_time)}


def _calls(reply: chat_reply.Reply | chat_reply.AssistantMessage) -> list[dict[str, Any]]:
    calls = reply.tool_calls
    found = []
    for call in calls:
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError:
            arguments = {}  # cut short: Ollama's arguments are an object
        found.append({"function": {"name": call.name, "arguments": arguments if isinstance(arguments, dict) else {}}})
    return found


class _Shaper:
    """Builds one Ollama answer (``chat``: a message; else generate's ``response``) whole
    or as NDJSON lines."""

    def __init__(self, model_name: str, reply_format: chat_reply.ReplyFormat, chat: bool, context: bool,
                 load: _LoadTimer) -> None:
        self.model_name, self.reply_format, self.chat, self.context = model_name, reply_format, chat, context
        self.load = load

    def _object(self, content: str, thinking: str | None, calls: list[dict[str, Any]], done: bool) -> dict[str, Any]:
        data: dict[str, Any] = {"model": self.model_name, "created_at": _now()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            data["message"] = message
        else:
            data["response"] = content
            if thinking:
                data["thinking"] = thinking
        data["done"] = done
        return data

    def _final(self, data: dict[str, Any], output: RequestOutput) -> dict[str, Any]:
        data.update(done_reason=output.finish_reason, **_timings(output, self.load.seconds))
        if self.context:  # generate's: the conversation so far, to send back as `context`
            data["context"] = list(output.prompt_token_ids) + list(output.token_ids)
        return data

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        [output] = outputs
        message = chat_reply.whole(self.reply_format, output.text)
        return self._final(self._object(message.content or "", message.reasoning_content, _calls(message), True),
                           output)

    async def chunks(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict]:
        reply = chat_reply.Reply(self.reply_format)
        async for _, output in outputs:
            delta = reply.feed(output.delta)
            if delta.get("content") or delta.get("reasoning_content"):
                yield self._object(delta.get("content", ""), delta.get("reasoning_content"), [], False)
            if output.finished:
                last = reply.finish()
                # Calls go out whole, at the end: Ollama's arguments are objects.
                yield self._final(self._object(last.get("content", ""), last.get("reasoning_content"),
                                               _calls(reply), True), output)


async def _load_or_unload(request: Request, model: str, keep_alive: str | float | None,
                          answer: Callable[[str], dict[str, Any]]) -> JSONResponse:
    """An empty request loads the model, or with ``keep_alive: 0`` unloads it."""
    manager = state_of(request).manager
    seconds = parse_keep_alive(keep_alive)
    if seconds == 0:
        name = manager.loaded_name(model)
        await manager.unload(name)
        return JSONResponse({**answer(name), "done_reason": "unload"})
    loaded = await manager.load(model, keep_alive=seconds)
    return JSONResponse({**answer(loaded.name), "done_reason": "load"})


@router.post("/api/chat")
async def chat(request: Request, body: ChatBody) -> Response:
    if not body.messages:
        return await _load_or_unload(request, body.model, body.keep_alive, lambda name: {
            "model": name, "created_at": _now(), "message": {"role": "assistant", "content": ""}, "done": True})
    openai_body = _chat_request(body.model, [_message(m) for m in body.messages], body, body.tools)
    prompt = ChatPrompt(openai_body, state_of(request).config)
    load = _LoadTimer()
    return await generate(request, openai_body, load.around(prompt.prompts),
                          lambda model, choices: _Shaper(body.model, prompt.reply_format, True, False, load),
                          prompt.sampling, OLLAMA_EVENTS, DEFAULT_OPTIONS, images=lambda: prompt.images)


@router.post("/api/generate")
async def generate_text(request: Request, body: GenerateBody) -> Response:
    if body.suffix:
        raise LocalserveError("suffix (fill-in-the-middle) is not supported")
    if body.template:
        raise LocalserveError("template is not supported: prompts are rendered with the model's own chat template "
                              "(or sent as they are with raw: true)")
    if body.images and body.raw:
        raise LocalserveError("images need the model's chat template to place them: send them with raw false")
    if not body.prompt:
        return await _load_or_unload(request, body.model, body.keep_alive, lambda name: {
            "model": name, "created_at": _now(), "response": "", "done": True})
    messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
        [{"role": "user", "content": body.prompt, **({"images": body.images} if body.images else {})}]
    openai_body = _chat_request(body.model, messages, body)
    prompt = ChatPrompt(openai_body, state_of(request).config)
    plain = chat_reply.ReplyFormat()

    def prompts(model: LoadedModel) -> list[list[int]]:
        # Raw, or a model without a chat template: the prompt as it is (Ollama's
        # "{{ .Prompt }}"); else rendered as one user turn, as Ollama renders it.
        if body.raw or not _templated(model):
            if body.images:
                raise LocalserveError(f"{model.name} has no chat template to place images in")
            ids = model.encode(body.prompt)
        else:
            ids = prompt.ids(model)
        return [list(body.context or []) + ids]  # `context`: the conversation an earlier answer gave back

    def shaper(model: LoadedModel, choices: list[gen.Choice]) -> _Shaper:
        templated = not body.raw and _templated(model)
        return _Shaper(body.model, prompt.reply_format if templated else plain, False, not body.raw, load)

    load = _LoadTimer()
    return await generate(request, openai_body, load.around(prompts), shaper, prompt.sampling, OLLAMA_EVENTS,
                          DEFAULT_OPTIONS, images=lambda: prompt.images)


@router.post("/api/embed")
async def embed(request: Request, body: EmbedBody) -> Response:
    inputs = [body.input] if isinstance(body.input, str) else list(body.input or [])
    if not inputs:
        return await _load_or_unload(request, body.model, body.keep_alive,
                                     lambda name: {"model": name, "embeddings": []})
    try:
        result = await embeddings.embed(request, body.model, inputs, PoolingParams(dimensions=body.dimensions),
                                        body.keep_alive, truncate=body.truncate)
    except gen.ClientGone:
        return Response(status_code=499)
    return JSONResponse({"model": body.model, "embeddings": [embeddings.as_floats(v) for v in result.vectors],
                         "total_duration": _ns(result.total_seconds), "load_duration": _ns(result.load_seconds),
                         "prompt_eval_count": result.prompt_tokens})


@router.post("/api/embeddings")
async def embeddings_legacy(request: Request, body: EmbeddingsBody) -> Response:
    """The older route: one prompt, and its vector not normalized (as Ollama's is not)."""
    if not body.prompt:
        await _load_or_unload(request, body.model, body.keep_alive, lambda name: {})
        return JSONResponse({"embedding": []})
    try:
        result = await embeddings.embed(request, body.model, [body.prompt], PoolingParams(normalize=False),
                                        body.keep_alive, truncate=True)
    except gen.ClientGone:
        return Response(status_code=499)
    return JSONResponse({"embedding": embeddings.as_floats(result.vectors[0])})
