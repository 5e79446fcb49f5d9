"""A whole benchmark: find the server and model, build the requests, drive the load,
compute the figures. ``run_benchmark`` is the synchronous entry point for scripts."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from .. import __version__
from .client import PATHS, RequestRecord, count_output_tokens, request_body, send_request
from .config import BenchConfig, BenchError
from .datasets import SampleRequest, sample_requests
from .load import Trace, arrival_times, drive
from .metrics import Metrics, compute_metrics
from .spec_decode import SpecDecodeCounts, read_spec_decode
from .tokenizer import ServerTokenizer, find_tokenizer

if TYPE_CHECKING:
    from .tokenizer import BenchTokenizer


@dataclass
class BenchResult:
    config: BenchConfig
    url: str
    model: str  # the name the requests carried
    metrics: Metrics
    records: list[RequestRecord]
    started_at: str = ""  # ISO 8601, UTC
    warmup_failures: int = 0
    # The server's speculative decoding over the run (warm-ups included), from its /metrics;
    # None where it exports no such counters.
    spec_decode: SpecDecodeCounts | None = None

    @property
    def first_error(self) -> str | None:
        return next((r.error for r in self.records if not r.success), None)

    def to_dict(self, requests: bool = True) -> dict[str, Any]:
        """JSON-ready: config, metrics (vLLM's flat keys) and, unless ``requests`` is
        False, every request's record."""
        data: dict[str, Any] = {
            "localserve_version": __version__, "started_at": self.started_at, "url": self.url,
            "model": self.model, "config": self.config.to_dict(), "metrics": self.metrics.to_dict(),
            "warmup_failures": self.warmup_failures, "first_error": self.first_error,
            "spec_decode": self.spec_decode.to_dict() if self.spec_decode else None,
        }
        if requests:
            data["requests"] = [r.to_dict() for r in self.records]
        return data


@dataclass
class Progress:
    """Callbacks a front end passes to follow a run (all optional)."""

    started: Callable[[str, int], None] | None = None  # (phase: "warmup"|"benchmark", total)
    done: Callable[[str, RequestRecord], None] | None = None  # one request of that phase finished


def run_benchmark(config: BenchConfig, progress: Progress | None = None) -> BenchResult:
    """Run ``config`` and return its result (not for use inside a running event loop:
    await ``arun_benchmark`` there). Raises BenchError when it cannot start (bad option,
    unreachable server, no tokenizer); failed requests are in the result, not raised."""
    return asyncio.run(arun_benchmark(config, progress))


async def arun_benchmark(config: BenchConfig, progress: Progress | None = None,
                         tokenizer: BenchTokenizer | None = None,
                         requests: list[SampleRequest] | None = None) -> BenchResult:
    """The async form; ``tokenizer`` and ``requests`` may be given to skip loading and
    sampling them (a comparison running the same requests against several servers)."""
    from ..client import daemon_url

    progress = progress or Progress()
    url = base_url(config.url or daemon_url())
    api_key = config.api_key if config.api_key is not None else os.environ.get("LOCALSERVE_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # No pool limit of its own: the concurrency cap is the semaphore in load.py, and a
    # pool wait would be counted as server latency.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=config.max_concurrency or 100)
    timeout = httpx.Timeout(connect=10.0, read=config.request_timeout, write=60.0, pool=None)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    own_tokenizer = None  # a server's tokenizer opened here, closed at the end
    try:
        async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as http:
            model = await served_model(http, url, config)
            if tokenizer is None:
                own_tokenizer = tokenizer = await asyncio.to_thread(
                    find_tokenizer, config.tokenizer, config.model, url, model, headers)
            if requests is None:
                # In a worker thread: a server's tokenizer answers over HTTP, synchronously.
                requests = await asyncio.to_thread(sample_requests, config, tokenizer)
            before = await read_spec_decode(http, url)
            trace = await _drive(config, progress, http, url, model, tokenizer, requests)
            after = await read_spec_decode(http, url)
        if isinstance(tokenizer, ServerTokenizer):
            # Outputs without a usage count are counted now, not while the load is measured.
            await asyncio.to_thread(count_output_tokens, trace.records, tokenizer)
    finally:
        if isinstance(own_tokenizer, ServerTokenizer):
            own_tokenizer.close()
    metrics = compute_metrics(trace.records, trace.duration, config.metric_percentiles, config.goodput)
    spec_decode = after.since(before) if before and after else None
    return BenchResult(config, url, model, metrics, trace.records, started_at, trace.warmup_failures, spec_decode)


async def _drive(config: BenchConfig, progress: Progress, http: httpx.AsyncClient, url: str, model: str,
                 tokenizer: BenchTokenizer, requests: list[SampleRequest]) -> Trace:
    arrivals = arrival_times(len(requests), config.request_rate, config.burstiness,
                             np.random.default_rng([config.seed, 1]))
    endpoint = url + PATHS[config.endpoint]
    bodies = {id(sample): request_body(config, model, sample, tokenizer.eos_token_id) for sample in requests}
    # A local tokenizer counts a usage-less output at once; a server's is left for after the run.
    counter = None if isinstance(tokenizer, ServerTokenizer) else tokenizer

    async def send(sample: SampleRequest, t0: float) -> RequestRecord:
        return await send_request(http, endpoint, bodies[id(sample)], sample, counter, t0)

    def done(phase: str) -> Callable[[RequestRecord], None] | None:
        callback = progress.done
        return None if callback is None else (lambda record: callback(phase, record))

    if progress.started is not None:
        if config.num_warmups:
            progress.started("warmup", config.num_warmups)
        progress.started("benchmark", len(requests))
    return await drive(requests, send, arrivals.tolist(), config.max_concurrency, config.num_warmups,
                       on_done=done("benchmark"), on_warmup_done=done("warmup"))


def base_url(url: str) -> str:
    """The server's root: ``http://host:8000`` from that, ``.../v1`` or a trailing slash."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise BenchError(f"--url {url!r}: expected http://HOST:PORT")
    return url.removesuffix("/v1")


async def served_model(http: httpx.AsyncClient, url: str, config: BenchConfig) -> str:
    """The model name to send, checking on the way that the server answers at all (a
    wrong URL should say so at once, not as N failed requests after the prompts are built)."""
    try:
        response = await http.get(url + "/v1/models", timeout=10.0)
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach a server at {url} ({str(exc) or type(exc).__name__}); is it running? "
                         "(--url, or LOCALSERVE_URL)") from exc
    name = config.served_model_name or config.model
    if name:
        return name
    # vLLM's default: the first model the server lists.
    try:
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPStatusError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchError(f"{url}/v1/models did not name a model (HTTP {response.status_code}); "
                         "give --model") from exc
