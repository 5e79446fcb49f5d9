"""What an engine reports about itself: ``EngineStats``, one typed snapshot that the
engine fills, the AsyncEngine completes with token rates, ``/metrics`` reads field by
field, ``/api/localserve/stats`` serializes (``as_dict``) and the dashboard reads back
(``from_dict``). A renamed field breaks its readers at once, not silently. And
``LoadProgress``: where a model's load stands, before there is an engine to report."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields


@dataclass(frozen=True, slots=True)
class EngineStats:
    # The KV cache: the device pool and the CPU tier, in blocks.
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int  # free blocks that still hold a named prefix
    kv_block_size: int
    kv_cache_dtype: str
    cpu_blocks_total: int
    cpu_blocks_used: int
    # The scheduler.
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    num_recomputes: int
    swap_out_blocks: int
    swap_in_blocks: int
    # The prefix cache, in prompt tokens.
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_cpu_hits: int
    # Totals since the engine started.
    num_prompt_tokens_total: int
    num_generated_tokens_total: int
    num_finished_requests: int
    # Speculative decoding (vLLM's spec_decode counters): verifications of one or more draft
    # tokens, the draft tokens verified, and of those the accepted (a daemon of an older
    # version reports none: 0).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # Tokens per second over the last seconds: the AsyncEngine's (None from a bare Engine).
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None

    def as_dict(self) -> dict[str, int | float | str | None]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> EngineStats | None:
        """The snapshot ``as_dict`` wrote (read back from ``/api/localserve/stats``), or None when a
        field is missing or of another type (a daemon of another version). Fields with a
        default may be absent, and keys this version does not know are ignored."""
        values: dict[str, object] = {}
        for spec in fields(cls):
            if spec.name not in data:
                if spec.default is MISSING:
                    return None
                continue
            value = data[spec.name]
            if not _FIELD_CHECKS[str(spec.type)](value):
                return None
            values[spec.name] = value
        return cls(**values)  # type: ignore[arg-type]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_FIELD_CHECKS: dict[str, Callable[[object], bool]] = {
    "int": _is_int,
    "str": lambda value: isinstance(value, str),
    "float | None": lambda value: value is None or _is_int(value) or isinstance(value, float),
}


@dataclass(slots=True)
class LoadProgress:
    """How far a model's load has got: written by the loading thread (plain attribute
    stores), read by the daemon's stats for the dashboard."""

    phase: str = "waiting to start"
    done: int = 0  # of ``total`` (the weights read so far, in tensors)
    total: int = 0
    started: float = field(default_factory=time.monotonic)

    def step(self, phase: str, total: int = 0) -> None:
        self.phase, self.done, self.total = phase, 0, total

    def as_dict(self) -> dict[str, object]:
        return {"phase": self.phase, "fraction": round(min(1.0, self.done / self.total), 3) if self.total else None,
                "elapsed_s": round(time.monotonic() - self.started, 1)}
