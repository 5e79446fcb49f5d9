"""What the engine gives back for a request: plain data, no torch, so the HTTP side (and a
front in another process than the engine) reads it without importing torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # of the sampled token, even when it is not among `top`
    top: list[tuple[int, float]]  # params.logprobs best (token_id, logprob), best first


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step. ``token_ids`` and ``text`` are cumulative;
    ``delta`` is the text new since this request's previous output.

    While the request runs, ``text`` leaves out a tail that may still become a stop
    string (which is cut off, not shown); once finished it is the whole answer."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta: str
    finished: bool
    finish_reason: str | None  # "stop" or "length" once finished
    logprobs: list[TokenLogprobs] | None
    # Entry p: prompt token p + 1 given the tokens before it (the first token has none);
    # complete from the first output on. None unless params.prompt_logprobs.
    prompt_logprobs: list[TokenLogprobs] | None
    # time.monotonic() readings, for TTFT, queue time and end-to-end latency.
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None  # None until finished
    # The stop string the text was cut at, when one ended the request (Anthropic's API
    # names it in its answer; the text alone cannot tell which of several matched).
    stop_string: str | None = None
    # An embedding request's vector (float32, CPU), set on its one, finished, output.
    embedding: torch.Tensor | None = None
