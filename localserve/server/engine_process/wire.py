"""What passes between the daemon and a model's engine process: length-prefixed JSON
frames on a Unix socket pair, and the codecs of the values they carry (plain data only:
nothing is ever unpickled). No torch here: the daemon's side imports this module."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import socket
import struct
from collections.abc import Sequence
from typing import Any

from ...engine.async_engine import EngineDeadError, QueueFullError
from ...engine.config import EngineConfig
from ...engine.output_format import OutputFormat
from ...engine.outputs import RequestOutput, TokenLogprobs
from ...engine.sampling_params import PoolingParams, SamplingParams
from ...engine.speculative.config import SpeculativeConfig
from ...engine.stats import EngineStats
from ...errors import InsufficientMemoryError, LocalserveError
from ...vision.image_input import ImageInput

_HEADER = struct.Struct("<I")
# The largest frame either side accepts: a step's outputs for every running request, or a
# request with a prompt at the longest context and a big structured-output schema.
MAX_FRAME_BYTES = 256 << 20


class ConnectionClosed(EOFError):
    """The other side closed the socket (or died)."""


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(body)) + body)


def receive(sock: socket.socket) -> dict[str, Any]:
    size, = _HEADER.unpack(_read_exactly(sock, _HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ConnectionClosed(f"a frame of {size:,} bytes is over the limit of {MAX_FRAME_BYTES:,}")
    message = json.loads(_read_exactly(sock, size))
    if not isinstance(message, dict):
        raise ConnectionClosed("a frame that is not a JSON object")
    return message


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except ConnectionResetError:  # it ended with our frame unread
            chunk = b""
        if not chunk:
            raise ConnectionClosed("the other side closed the connection")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


# -- the values ---------------------------------------------------------------------------


def engine_config_to_wire(config: EngineConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def engine_config_from_wire(data: dict[str, Any]) -> EngineConfig:
    return EngineConfig(**{**data, "speculative": SpeculativeConfig(**data["speculative"])})


def sampling_params_to_wire(params: SamplingParams) -> dict[str, Any]:
    data = {field.name: getattr(params, field.name) for field in dataclasses.fields(params)}
    data["logit_bias"] = [[token, bias] for token, bias in params.logit_bias.items()]
    data["thinking_end"] = list(params.thinking_end)
    fmt = params.output_format
    data["output_format"] = None if fmt is None else {"kind": fmt.kind, "value": fmt.value}
    return data


def sampling_params_from_wire(data: dict[str, Any]) -> SamplingParams:
    fmt = data["output_format"]
    return SamplingParams(**{**data, "logit_bias": {int(token): float(bias) for token, bias in data["logit_bias"]},
                             "thinking_end": tuple(data["thinking_end"]),
                             "output_format": None if fmt is None else OutputFormat(fmt["kind"], fmt["value"])})


def pooling_to_wire(pooling: PoolingParams | None) -> dict[str, Any] | None:
    return None if pooling is None else dataclasses.asdict(pooling)


def pooling_from_wire(data: dict[str, Any] | None) -> PoolingParams | None:
    return None if data is None else PoolingParams(**data)


def images_to_wire(images: Sequence[ImageInput]) -> list[dict[str, Any]]:
    return [{"data": base64.b64encode(image.data).decode(), "width": image.width, "height": image.height,
             "format": image.format} for image in images]


def images_from_wire(data: list[dict[str, Any]]) -> list[ImageInput]:
    """The images the daemon checked (vision/image_input.py), not decoded again here: their
    decode checks the header against the size the daemon read, so the checks still hold."""
    images = []
    for entry in data:
        raw = base64.b64decode(entry["data"], validate=True)
        images.append(ImageInput(raw, hashlib.sha256(raw).digest(), int(entry["width"]), int(entry["height"]),
                                 str(entry["format"])))
    return images


def _logprobs_to_wire(entries: list[TokenLogprobs]) -> list[list[Any]]:
    return [[entry.token_id, entry.logprob, [list(pair) for pair in entry.top]] for entry in entries]


def _logprobs_from_wire(entries: list[list[Any]]) -> list[TokenLogprobs]:
    return [TokenLogprobs(token_id, logprob, [(token, value) for token, value in top])
            for token_id, logprob, top in entries]


def output_to_wire(output: RequestOutput, sent_tokens: int, sent_logprobs: int) -> dict[str, Any]:
    """``output`` as what is new since the ``sent_tokens`` tokens and ``sent_logprobs``
    logprob entries sent before (outputs are cumulative; sending them whole would grow with
    the square of the answer)."""
    return {
        "id": output.request_id, "tokens": output.token_ids[sent_tokens:], "delta": output.delta,
        "finished": output.finished, "finish_reason": output.finish_reason,
        "logprobs": None if output.logprobs is None else _logprobs_to_wire(output.logprobs[sent_logprobs:]),
        "prompt_logprobs": None if output.prompt_logprobs is None or sent_tokens else
        _logprobs_to_wire(output.prompt_logprobs),
        "times": [output.arrival_time, output.first_scheduled_time, output.first_token_time, output.finish_time],
        "stop_string": output.stop_string,
        "embedding": None if output.embedding is None else output.embedding.tolist(),
    }


def output_from_wire(data: dict[str, Any], previous: RequestOutput | None, prompt: list[int],
                     clock_offset: float) -> RequestOutput:
    """The cumulative output ``data`` continues from ``previous`` (None for the first);
    ``clock_offset`` moves the engine process's monotonic times onto this one's."""
    times = [None if t is None else t + clock_offset for t in data["times"]]
    logprobs = None if data["logprobs"] is None else \
        (previous.logprobs if previous and previous.logprobs else []) + _logprobs_from_wire(data["logprobs"])
    prompt_logprobs = _logprobs_from_wire(data["prompt_logprobs"]) if data["prompt_logprobs"] is not None else \
        (previous.prompt_logprobs if previous else None)
    embedding = data["embedding"]
    if embedding is not None:
        import numpy

        embedding = numpy.asarray(embedding, dtype=numpy.float32)
    return RequestOutput(
        request_id=data["id"], prompt_token_ids=prompt,
        token_ids=(previous.token_ids if previous else []) + data["tokens"],
        text=(previous.text if previous else "") + data["delta"], delta=data["delta"], finished=data["finished"],
        finish_reason=data["finish_reason"], logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        arrival_time=times[0], first_scheduled_time=times[1], first_token_time=times[2], finish_time=times[3],
        stop_string=data["stop_string"], embedding=embedding)


def stats_from_wire(data: dict[str, Any] | None) -> EngineStats | None:
    return None if data is None else EngineStats.from_dict(data)


# An error that crosses, by kind: the daemon raises the same class the engine did, so its
# routes answer as for an engine on a thread (429, 503 after unloading, 400, 500).
_ERROR_KINDS: tuple[tuple[str, type[BaseException]], ...] = (
    ("queue_full", QueueFullError), ("memory", InsufficientMemoryError), ("user", LocalserveError))


def error_to_wire(exc: BaseException) -> dict[str, str]:
    kind = next((name for name, cls in _ERROR_KINDS if isinstance(exc, cls)), "engine")
    return {"kind": kind, "error": str(exc)}


def error_from_wire(data: dict[str, Any], engine_error: type[BaseException] = EngineDeadError) -> BaseException:
    """The error ``error_to_wire`` sent; ``engine_error`` for a failure of the engine itself."""
    cls = next((cls for name, cls in _ERROR_KINDS if name == data["kind"]), engine_error)
    return cls(data["error"])
