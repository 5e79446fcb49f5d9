"""Embeddings: OpenAI's /v1/embeddings, and what Ollama's /api/embed and /api/embeddings
(ollama_api.py) share with it: inputs tokenized (truncated to the context when asked),
run through the engine as embedding requests, at most ``max_num_seqs`` at once so that a
request of thousands of inputs neither fills the queue nor starves other clients, and
aborted if the client goes away.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..engine.outputs import RequestOutput
from ..engine.sampling_params import PoolingParams
from ..errors import LocalserveError
from . import generation as gen
from .model_manager import MAX_CHARS_PER_TOKEN, LoadedModel, parse_keep_alive
from .openai_api import acquire
from .protocol import EmbeddingRequest
from .state import state_of

if TYPE_CHECKING:
    import torch

router = APIRouter()


@dataclass(slots=True)
class Embeddings:
    vectors: list[torch.Tensor | numpy.ndarray]  # float32, one per input, in input order (numpy from an engine process)
    prompt_tokens: int
    load_seconds: float  # waiting for the model to load (0 when it was loaded)
    total_seconds: float


async def embed(request: Request, model_name: str, inputs: list[str | list[int]], pooling: PoolingParams,
                keep_alive: str | float | None = None, truncate: bool = False) -> Embeddings:
    """Embed every input with model ``model_name``. ``truncate``: inputs longer than the
    context keep their first tokens (Ollama's default); otherwise they are refused."""
    started, arrived = time.monotonic(), time.time()
    state = state_of(request)
    model = await acquire(request, model_name)
    load_seconds = model.load_wait(arrived)
    try:
        if not model.embeds:
            raise LocalserveError(f"{model.name!r} makes text, not embeddings: serve an embedding model "
                                  "(Qwen3-Embedding, or a GGUF file that names a pooling type)")
        pooling.check(model.hidden_size)
        prompts = await asyncio.to_thread(_tokenize, model, inputs, truncate)
        outputs = await gen.unless_disconnected(request, _run(model, prompts, pooling))
    finally:
        state.manager.release(model, parse_keep_alive(keep_alive))
    return Embeddings([o.embedding for o in outputs], sum(len(p) for p in prompts),  # type: ignore[misc]
                      load_seconds, time.monotonic() - started)


def _tokenize(model: LoadedModel, inputs: list[str | list[int]], truncate: bool) -> list[list[int]]:
    context = model.max_model_len
    prompts = []
    for index, item in enumerate(inputs):
        if isinstance(item, str):
            ids = model.encode(item[: context * MAX_CHARS_PER_TOKEN] if truncate else item)
        else:
            if any(token >= model.vocab_size for token in item):
                raise LocalserveError(f"input {index}: token ids must be in [0, {model.vocab_size})")
            ids = list(item)
        if not ids:
            raise LocalserveError(f"input {index} is empty")
        if len(ids) > context:
            if not truncate:
                raise LocalserveError(f"input {index} has {len(ids):,} tokens, more than {model.name}'s context of "
                                      f"{context:,}; shorten it")
            ids = ids[:context]
        prompts.append(ids)
    return prompts


async def _run(model: LoadedModel, prompts: list[list[int]], pooling: PoolingParams) -> list[RequestOutput]:
    """Each prompt's finished output, in order; at most ``max_num_seqs`` in the engine at
    once. If one fails or this is cancelled, the others are aborted."""
    outputs: list[RequestOutput | None] = [None] * len(prompts)
    window = asyncio.Semaphore(model.max_num_seqs)

    async def one(index: int, ids: list[int]) -> None:
        async with window:
            stream = await model.engine.add_request(ids, None, pooling=pooling)
            try:
                async for output in stream:
                    outputs[index] = output
            finally:
                stream.close()

    try:
        async with asyncio.TaskGroup() as group:
            for index, ids in enumerate(prompts):
                group.create_task(one(index, ids))
    except BaseExceptionGroup as failed:  # the first failure is the answer (the rest were cancelled)
        raise failed.exceptions[0] from None
    return outputs  # type: ignore[return-value]


def as_floats(vector: torch.Tensor | numpy.ndarray) -> list[float]:
    return vector.tolist()


def as_base64(vector: torch.Tensor | numpy.ndarray) -> str:
    """OpenAI's ``encoding_format: base64``: the float32 values' little-endian bytes."""
    return base64.b64encode(numpy.asarray(vector, dtype="<f4").tobytes()).decode()


@router.post("/v1/embeddings")
async def embeddings(request: Request, body: EmbeddingRequest) -> Response:
    try:
        result = await embed(request, body.model, body.inputs(), PoolingParams(dimensions=body.dimensions),
                             body.keep_alive)
    except gen.ClientGone:
        return Response(status_code=499)
    encode = as_base64 if body.encoding_format == "base64" else as_floats
    return JSONResponse({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(result.vectors)],
        "model": body.model,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    })
