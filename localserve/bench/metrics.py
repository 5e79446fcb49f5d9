"""The figures of a run, from its per-request records, with vLLM's definitions:

- TTFT: send -> first generated text; E2EL: send -> last chunk;
- TPOT: per request, (E2EL - TTFT) / (output tokens - 1), for requests with more than one
  output token (decode speed as that request saw it, the first token left out);
- ITL: every gap between successive text chunks, all requests pooled;
- throughputs over the run's duration (first arrival slot to last response);
- goodput: completed requests per second that met every SLO given (a request with at most
  one output token has TPOT 0 there);
- peak concurrency: the most requests open at once, [sent, closed) intervals swept.

Latencies come out in milliseconds as mean, median, std (population, as numpy's default)
and the percentiles asked for (numpy's linear interpolation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .client import RequestRecord

LATENCIES = ("ttft", "tpot", "itl", "e2el")
LATENCY_NAMES = {"ttft": "time to first token", "tpot": "time per output token after the first",
                 "itl": "inter-token latency", "e2el": "end-to-end latency"}


@dataclass(frozen=True)
class Distribution:
    """One latency's summary in ms; all None when it has no samples."""

    count: int
    mean: float | None
    median: float | None
    std: float | None
    percentiles: dict[float, float | None]

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[float]) -> Distribution:
        if not len(seconds):
            return cls(0, None, None, None, {p: None for p in percentiles})
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        return cls(len(ms), float(np.mean(ms)), float(np.median(ms)), float(np.std(ms)),
                   {p: float(np.percentile(ms, p)) for p in percentiles})


@dataclass(frozen=True)
class Metrics:
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    duration: float  # seconds
    request_throughput: float  # completed requests/s
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (input + output) tokens/s
    request_goodput: float | None  # requests/s meeting every SLO; None without SLOs
    max_concurrent_requests: int
    max_output_tokens_per_s: float  # the busiest one-second bucket
    latencies: dict[str, Distribution] = field(default_factory=dict)  # LATENCIES -> summary

    def to_dict(self) -> dict[str, Any]:
        """Flat keys as vLLM's result JSON names them (mean_ttft_ms, p99_itl_ms, ...)."""
        data: dict[str, Any] = {
            "completed": self.completed, "failed": self.failed, "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens, "duration": self.duration,
            "request_throughput": self.request_throughput, "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput, "request_goodput": self.request_goodput,
            "max_concurrent_requests": self.max_concurrent_requests,
            "max_output_tokens_per_s": self.max_output_tokens_per_s,
        }
        for name, dist in self.latencies.items():
            data[f"mean_{name}_ms"] = dist.mean
            data[f"median_{name}_ms"] = dist.median
            data[f"std_{name}_ms"] = dist.std
            for p, value in dist.percentiles.items():
                data[f"p{percentile_label(p)}_{name}_ms"] = value
        return data


def percentile_label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def compute_metrics(records: Sequence[RequestRecord], duration: float, percentiles: Sequence[float] = (99.0,),
                    goodput: dict[str, float] | None = None) -> Metrics:
    done = [r for r in records if r.success]
    ttfts = [r.ttft for r in done]
    e2els = [r.e2el for r in done]
    tpots = [request_tpot(r) for r in done]
    itls = [gap for r in done for gap in r.itl]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    per_s = 1.0 / duration if duration > 0 else 0.0
    good = None
    if goodput:
        good = sum(1 for r in done if meets_slos(r, goodput)) * per_s
    return Metrics(
        completed=len(done), failed=len(records) - len(done), total_input_tokens=total_in,
        total_output_tokens=total_out, duration=duration, request_throughput=len(done) * per_s,
        output_throughput=total_out * per_s, total_token_throughput=(total_in + total_out) * per_s,
        request_goodput=good, max_concurrent_requests=peak_concurrency(records),
        max_output_tokens_per_s=float(max(output_tokens_per_bucket(done, 1.0)[1], default=0.0)),
        latencies={
            "ttft": Distribution.of(ttfts, percentiles),
            "tpot": Distribution.of([t for t in tpots if t is not None], percentiles),
            "itl": Distribution.of(itls, percentiles),
            "e2el": Distribution.of(e2els, percentiles),
        },
    )


def request_tpot(record: RequestRecord) -> float | None:
    if record.output_tokens <= 1:
        return None
    return (record.e2el - record.ttft) / (record.output_tokens - 1)


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": record.ttft, "tpot": request_tpot(record) or 0.0, "e2el": record.e2el}
    return all(values[name] <= limit / 1000.0 for name, limit in slos_ms.items())


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """The most requests open at once. A request that ends at the instant another starts
    does not overlap it (half-open intervals: ends sort before starts)."""
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records])
    peak = open_now = 0
    for _, step in events:
        open_now += step
        peak = max(peak, open_now)
    return peak


def token_times(record: RequestRecord) -> tuple[np.ndarray, np.ndarray]:
    """When a request's output arrived (seconds from the run's start) and how many tokens
    each arrival carried: the text chunks, sharing the output tokens evenly (a server
    may pack several tokens in one chunk)."""
    times = record.start + record.ttft + np.concatenate([[0.0], np.cumsum(record.itl)])
    if not record.chunks:
        return times[:0], times[:0]
    return times, np.full(len(times), record.output_tokens / len(times))


def output_tokens_per_bucket(records: Sequence[RequestRecord], width: float) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens/s in buckets of ``width`` seconds from the run's start: (bucket
    starts, rates)."""
    pairs = [token_times(r) for r in records if r.success]
    if not pairs:
        return np.zeros(0), np.zeros(0)
    times = np.concatenate([t for t, _ in pairs])
    weights = np.concatenate([w for _, w in pairs])
    if not len(times):
        return np.zeros(0), np.zeros(0)
    buckets = max(1, math.ceil(float(times.max()) / width + 1e-9))
    index = np.minimum((times // width).astype(int), buckets - 1)
    counts = np.bincount(index, weights=weights, minlength=buckets)
    return np.arange(buckets) * width, counts / width
