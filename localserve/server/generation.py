"""From a validated request to engine streams and back: sampling parameters, fan-out
over prompts and ``n`` choices, merging the choices' streams, and cancelling when the
client goes away. Knows nothing of the response shapes (openai_api.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request

from ..engine.async_engine import RequestStream
from ..engine.outputs import RequestOutput
from ..engine.outputs import TokenLogprobs
from ..engine.sampling_params import SamplingParams
from ..text.tokenizer import Tokenizer
from ..vision.image_input import ImageInput
from .metrics import Metrics
from .model_manager import LoadedModel
from .protocol import ChatCompletionRequest, CompletionRequest

GenerationRequest = ChatCompletionRequest | CompletionRequest

T = TypeVar("T")
# Logprobs of tokens the model thinks impossible are -inf, which JSON cannot carry.
LOGPROB_FLOOR = -9999.0


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


@dataclass(slots=True)
class Choice:
    """One engine request: choice ``index`` of the response, for prompt ``prompt_index``."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    images: Sequence[ImageInput] = ()  # laid out in prompt_ids already (vision/placement.py)


def sampling_params(body: GenerationRequest, prompt_len: int, max_model_len: int, seed_offset: int = 0,
                    defaults: Mapping[str, Any] | None = None, **extra: Any) -> SamplingParams:
    """The engine's parameters for one choice. A field the request leaves out takes its
    value from ``defaults`` (the model's own, over the API's: Ollama's temperature 0.8),
    else the OpenAI default; without a token limit, the rest of the context.
    ``extra``: further SamplingParams fields the endpoint worked out (a thinking budget,
    special tokens kept for a tool-call parser)."""
    defaults = defaults or {}
    given = body.model_fields_set

    def field(name: str, fallback: Any) -> Any:
        value = getattr(body, name) if name in given else None
        value = defaults.get(name) if value is None else value
        return fallback if value is None else value

    room = max(1, max_model_len - prompt_len)
    seed = field("seed", None)
    seed = None if seed is None else (seed + seed_offset) % (1 << 64)  # choices differ
    stop = field("stop", [])
    fields: dict[str, Any] = dict(
        # a model's default length never asks for more than the context has left
        max_tokens=body.wanted_tokens() or min(defaults.get("max_tokens", room), room),
        temperature=field("temperature", 1.0),
        top_p=field("top_p", 1.0),
        top_k=field("top_k", 0),
        min_p=field("min_p", 0.0),
        repetition_penalty=field("repetition_penalty", 1.0),
        presence_penalty=field("presence_penalty", 0.0),
        frequency_penalty=field("frequency_penalty", 0.0),
        seed=seed,
        stop=[stop] if isinstance(stop, str) else list(stop),
        stop_token_ids=list(body.stop_token_ids or []),
        include_stop_str_in_output=body.include_stop_str_in_output,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logprobs=body.wanted_logprobs(),
        prompt_logprobs=body.wanted_prompt_logprobs(),
        skip_special_tokens=body.skip_special_tokens,
        logit_bias={int(token): bias for token, bias in (body.logit_bias or {}).items()},
        output_format=body.output_format(),
        num_speculative_tokens=field("num_speculative_tokens", None),
        speculative_method=body.speculative_method,
    )
    return SamplingParams(**{**fields, **extra})


def choices_for(body: GenerationRequest, prompts: list[list[int]], max_model_len: int,
                defaults: Mapping[str, Any] | None = None, images: Sequence[ImageInput] = (),
                **extra: Any) -> list[Choice]:
    """``body.n`` choices per prompt, numbered prompt-major as OpenAI does; ``images``: those
    the prompts lay out (a chat's one prompt)."""
    n = body.n
    return [Choice(p * n + j, p, ids, sampling_params(body, len(ids), max_model_len, j, defaults, **extra), images)
            for p, ids in enumerate(prompts) for j in range(n)]


async def start(model: LoadedModel, choices: list[Choice]) -> list[RequestStream]:
    """Submit every choice; if one is refused, abort the ones already started."""
    streams: list[RequestStream] = []
    try:
        for choice in choices:
            streams.append(await model.engine.add_request(choice.prompt_ids, choice.params, images=choice.images))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


class Progress:
    """Watches one choice's outputs for metrics: token gaps and, at the end, timings."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.metrics = metrics
        self.model = model
        self.tokens_seen = 0
        self.last_time: float | None = None

    def update(self, output: RequestOutput) -> None:
        now = time.monotonic()
        new = len(output.token_ids) - self.tokens_seen
        if new > 0:
            if self.last_time is not None:
                self.metrics.observe_token_gap(self.model, now - self.last_time, new)
            self.last_time = now
            self.tokens_seen += new
        if output.finished:
            self.metrics.observe_finished(self.model, output)


async def merged(streams: list[RequestStream], progress: list[Progress]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from all streams as they arrive; closes them all at the end."""
    try:
        if len(streams) == 1:  # the common case needs no tasks
            async for output in streams[0]:
                progress[0].update(output)
                yield 0, output
            return
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((index, output))
            except Exception as exc:
                queue.put_nowait(exc)
            queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    progress[item[0]].update(item[1])
                    yield item
        finally:
            for task in tasks:
                task.cancel()
    finally:
        for stream in streams:
            stream.close()


async def final_outputs(request: Request, streams: list[RequestStream], progress: list[Progress]) -> list[RequestOutput]:
    """Every stream's last output; if the client disconnects first, aborts them all and
    raises ClientGone."""

    async def collect() -> list[RequestOutput]:
        last: list[RequestOutput | None] = [None] * len(streams)
        async for index, output in merged(streams, progress):
            last[index] = output
        return [output for output in last if output is not None]

    try:
        return await unless_disconnected(request, collect())
    finally:
        for stream in streams:
            stream.close()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (which aborts its engine requests) if the client
    disconnects first; then raises ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def token_text(tokenizer: Tokenizer | None, token_id: int) -> tuple[str, list[int]]:
    """A token's text and bytes, as OpenAI's logprobs show them."""
    if tokenizer is None:
        return f"token_id:{token_id}", []
    data = tokenizer.token_bytes(token_id)
    return data.decode("utf-8", errors="replace"), list(data)


def clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def entries(logprobs: list[TokenLogprobs] | None, start: int) -> list[TokenLogprobs]:
    return list(logprobs[start:]) if logprobs else []
