"""When requests go out: arrival times drawn from a gamma process, a cap on requests in
flight, warm-ups before the clock starts. Knows nothing of HTTP: it calls ``send``."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .client import RequestRecord
from .datasets import SampleRequest

# send(sample, t0) -> its record, times measured from t0 (a time.perf_counter() value)
Send = Callable[[SampleRequest, float], Awaitable[RequestRecord]]


def request_gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` gaps between arrivals in seconds, as vLLM draws them: gamma with shape
    ``burstiness`` and scale ``1 / (rate * burstiness)``, so the mean gap is 1/rate for
    any burstiness and the coefficient of variation is 1/sqrt(burstiness) (1: a Poisson
    process; below 1 burstier, above 1 more even). An infinite rate sends all at once."""
    if math.isinf(rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        return np.full(n, 1.0 / rate)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds from the start at which each request is due. Like vLLM, the cumulative
    gaps are rescaled so the last one is due at exactly n / rate: the sum of random gaps
    misses it by a few percent, which would move the offered load (and the throughput
    measured) from one seed to the next. Rescaling keeps the shape (and the CV)."""
    times = np.cumsum(request_gaps(n, rate, burstiness, rng))
    if n and times[-1] > 0:
        times *= (n / rate) / times[-1]
    return times


@dataclass
class Trace:
    records: list[RequestRecord]  # in dataset order
    duration: float  # seconds from the first arrival slot to the last response
    warmup_failures: int = 0


async def drive(requests: Sequence[SampleRequest], send: Send, arrivals: Sequence[float],
                max_concurrency: int | None = None, num_warmups: int = 0,
                on_done: Callable[[RequestRecord], None] | None = None,
                on_warmup_done: Callable[[RequestRecord], None] | None = None) -> Trace:
    """Send ``num_warmups`` copies of the first request (not measured), then every
    request at its arrival time, with at most ``max_concurrency`` in flight."""
    # A request that arrives while the cap is reached waits here, client side, and its
    # clock starts when it is sent: vLLM's definition of max concurrency.
    slots: contextlib.AbstractAsyncContextManager = (
        asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext())

    async def limited(sample: SampleRequest, t0: float, done: Callable[[RequestRecord], None] | None
                      ) -> RequestRecord:
        async with slots:
            record = await send(sample, t0)
        if done is not None:
            done(record)
        return record

    trace = Trace(records=[], duration=0.0)
    if num_warmups and requests:
        # The first request repeated, at once: it loads the model, warms caches and the
        # connection pool, as vLLM's warm-up does.
        t0 = time.perf_counter()
        warm = await asyncio.gather(*(limited(requests[0], t0, on_warmup_done) for _ in range(num_warmups)))
        trace.warmup_failures = sum(1 for r in warm if not r.success)

    t0 = time.perf_counter()
    tasks: list[asyncio.Task[RequestRecord]] = []
    for sample, due in zip(requests, arrivals, strict=True):
        delay = t0 + due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(sample, t0, on_done)))
    trace.records = list(await asyncio.gather(*tasks))
    trace.duration = time.perf_counter() - t0
    return trace
