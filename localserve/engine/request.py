"""One generation request and its progress through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .sampling_params import PoolingParams, SamplingParams
from .outputs import TokenLogprobs
from .speculative.state import RequestSpeculation
from .structured_output import Constraint

if TYPE_CHECKING:
    from ..vision.encoder import ImageSpan


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not started, or preempted and waiting to recompute
    RUNNING = "running"  # holds KV blocks, scheduled every step it fits
    SWAPPED = "swapped"  # preempted with its KV blocks copied to the CPU tier
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # prompt followed by the generated tokens; what a recompute prefills again.
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)  # device blocks
    cpu_block_table: list[int] = field(default_factory=list)  # while SWAPPED
    block_hashes: list[bytes] = field(default_factory=list)  # names of its full blocks so far
    num_cached_blocks: int = 0  # leading blocks of block_table already named in the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" or "length" (or "abort")
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Entry p: prompt token p + 1 given the tokens before it; None unless params.prompt_logprobs.
    prompt_logprobs: list[TokenLogprobs] | None = None
    first_scheduled_time: float | None = None  # queue time: first_scheduled_time - arrival_time
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    constraint: Constraint | None = None  # where a structured output's grammar stands
    forced_token_ids: list[int] = field(default_factory=list)  # the next tokens, whatever the model says
    thinking_closed: bool = False  # the think block it began in (params.thinking_end) is closed
    # An embedding request (engine/pooling.py): prefilled, never decoded; ``pooled`` is
    # the state folded from the hidden states computed so far.
    pooling: PoolingParams | None = None
    pooling_method: str | None = None
    pooled: torch.Tensor | None = None
    # Speculative decoding (engine/speculative/): the tokens proposed to follow token_ids,
    # verified in the next step, and what the speculator keeps about the request.
    draft_token_ids: list[int] = field(default_factory=list)
    speculation: RequestSpeculation | None = None
    images: list[ImageSpan] = field(default_factory=list)  # where its images' tokens are (vision/encoder.py)
    # Qwen-VL's M-RoPE (vision/mrope.py): the prompt's [3, tokens] rotary positions when it
    # holds images, and how far the positions past it run ahead of their index.
    mrope_positions: torch.Tensor | None = None
    position_delta: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = []

    @property
    def active_constraint(self) -> Constraint | None:
        """The grammar the next token must follow: none while the request thinks."""
        return self.constraint if self.thinking_closed or not self.params.thinking_end else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_logprobs_owed_from(self) -> int | None:
        """The first position whose prompt logprob (of the token after it) is asked for and
        not computed yet; every later prompt position but the last is owed too. None if none is."""
        if self.prompt_logprobs is None or len(self.prompt_logprobs) >= self.num_prompt_tokens - 1:
            return None
        return len(self.prompt_logprobs)

    @property
    def reusable_prefix_tokens(self) -> int:
        """How many leading tokens may take their K/V from the prefix cache: all but the
        last (its logits or hidden state are needed), before any prompt position still owed
        a prompt logprob, and none where the embedding pools over every position or the
        first."""
        if self.pooling_method in ("mean", "cls"):
            return 0
        owed_from = self.prompt_logprobs_owed_from
        return self.num_tokens - 1 if owed_from is None else owed_from

    def rope_positions(self, start: int, end: int) -> torch.Tensor:
        """``[3, end - start]`` rotary positions of tokens ``start`` to ``end`` of a request
        with M-RoPE positions: the prompt's as laid out, the rest their index plus the delta."""
        assert self.mrope_positions is not None
        prompt = self.num_prompt_tokens
        inside = self.mrope_positions[:, start:min(end, prompt)]
        if end <= prompt:
            return inside
        after = torch.arange(max(start, prompt), end) + self.position_delta
        return torch.cat((inside, after.expand(3, -1)), dim=1)

    def image_key(self, start: int, end: int) -> bytes:
        """The hashes of the images whose tokens fall in positions ``start`` to ``end``: an
        image's placeholder tokens are the same for every image, so a cached block's name
        must say which image filled them."""
        return b"".join(span.image.digest for span in self.images if span.start < end and start < span.end)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
