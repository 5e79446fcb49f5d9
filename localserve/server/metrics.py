"""Prometheus metrics (``GET /metrics``) and the recent latencies ``/api/localserve/stats`` shows.

Engine counters and gauges are read from each loaded model's statistics snapshot at
scrape time (a model's series disappear when it unloads, as a restarted process's
would); latency histograms are observed by the server as requests finish.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.outputs import RequestOutput
from ..engine.stats import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                      1.0, 2.5)
_RECENT = 200  # finished requests kept per model for /api/localserve/stats

# (EngineStats field, metric name, help)
_GAUGES = [
    ("num_running", "num_requests_running", "Requests in the running batch"),
    ("num_waiting", "num_requests_waiting", "Requests waiting to start (or to recompute after preemption)"),
    ("num_swapped", "num_requests_swapped", "Requests preempted with their KV cache in the CPU tier"),
]
_COUNTERS = [
    ("num_prompt_tokens_total", "prompt_tokens", "Prompt tokens computed (cached prefixes excluded)"),
    ("num_generated_tokens_total", "generation_tokens", "Tokens generated"),
    ("num_preemptions", "num_preemptions", "Requests preempted for lack of KV blocks"),
    ("num_recomputes", "num_recomputes", "Preempted requests whose KV cache was freed, to be recomputed "
     "(the others swapped to the CPU tier)"),
    ("swap_out_blocks", "kv_blocks_swapped_out", "KV cache blocks copied from the device to the CPU tier"),
    ("swap_in_blocks", "kv_blocks_swapped_in", "KV cache blocks copied from the CPU tier back to the device"),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "Speculative decoding: verifications of draft tokens"),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified"),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
     "Speculative decoding: draft tokens accepted (each a token gained over plain decoding)"),
]


@dataclass(slots=True)
class FinishedTiming:
    ttft: float
    tpot: float | None  # mean seconds per output token after the first
    e2e: float


class EngineCollector(Collector):
    """Reads ``{model name: EngineStats}`` at scrape time."""

    def __init__(self, snapshots: Callable[[], dict[str, EngineStats]]) -> None:
        self._snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        snapshots = self._snapshots()
        for key, name, help_text in _GAUGES:
            yield _family(GaugeMetricFamily, name, help_text, snapshots, key)
        for key, name, help_text in _COUNTERS:
            yield _family(CounterMetricFamily, name, help_text, snapshots, key)
        usage = GaugeMetricFamily("localserve_kv_cache_usage_ratio", "Share of KV cache blocks in use",
                                  labels=["model", "tier"])
        for model, stats in snapshots.items():
            usage.add_metric([model, "device"], _ratio(stats.kv_blocks_used, stats.kv_blocks_total))
            usage.add_metric([model, "cpu"], _ratio(stats.cpu_blocks_used, stats.cpu_blocks_total))
        yield usage


def _family(kind: type, name: str, help_text: str, snapshots: dict[str, EngineStats], field: str) -> Metric:
    family = kind(f"localserve_{name}", help_text, labels=["model"])
    for model, stats in snapshots.items():
        family.add_metric([model], getattr(stats, field))
    return family


def _ratio(used: int, total: int) -> float:
    return used / total if total else 0.0


class Metrics:
    def __init__(self, snapshots: Callable[[], dict[str, EngineStats]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(snapshots))

        def histogram(name: str, help_text: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(f"localserve_{name}", help_text, ["model"], buckets=tuple(buckets),
                             registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token", _LATENCY_BUCKETS)
        self.inter_token = histogram("inter_token_latency_seconds", "Time between a request's consecutive tokens",
                                     _TOKEN_GAP_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token", _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled step", _LATENCY_BUCKETS)
        self.finished = Counter("localserve_request_success", "Requests finished, by reason",
                                ["model", "finished_reason"], registry=self.registry)
        self.recent: dict[str, deque[FinishedTiming]] = {}

    def observe_token_gap(self, model: str, seconds: float, tokens: int) -> None:
        """``tokens`` arrived ``seconds`` after the previous ones (one gap per token)."""
        child = self.inter_token.labels(model)
        for _ in range(tokens):
            child.observe(seconds / tokens)

    def observe_finished(self, model: str, output: RequestOutput) -> None:
        arrival, first, finish = output.arrival_time, output.first_token_time, output.finish_time
        if first is None or finish is None:
            return
        self.finished.labels(model, output.finish_reason or "unknown").inc()
        self.ttft.labels(model).observe(first - arrival)
        self.e2e.labels(model).observe(finish - arrival)
        if output.first_scheduled_time is not None:
            self.queue.labels(model).observe(output.first_scheduled_time - arrival)
        num_tokens = len(output.token_ids)
        tpot = (finish - first) / (num_tokens - 1) if num_tokens > 1 else None
        self.recent.setdefault(model, deque(maxlen=_RECENT)).append(FinishedTiming(first - arrival, tpot, finish - arrival))

    def recent_summary(self, model: str) -> dict[str, float | int | None]:
        """p50 and p99 TTFT/TPOT (ms) over the model's last finished requests."""
        timings = list(self.recent.get(model, ()))
        ttft = [t.ttft for t in timings]
        tpot = [t.tpot for t in timings if t.tpot is not None]
        return {"requests": len(timings), **_percentiles("ttft_ms", ttft), **_percentiles("tpot_ms", tpot)}

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _percentiles(name: str, values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"{name}_p50": None, f"{name}_p99": None}
    # The inclusive method keeps p99 within the values seen (at most their maximum).
    p99 = statistics.quantiles(values, n=100, method="inclusive")[-1] if len(values) > 1 else values[0]
    return {f"{name}_p50": round(statistics.median(values) * 1000, 2), f"{name}_p99": round(p99 * 1000, 2)}
