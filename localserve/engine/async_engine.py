"""The engine's step loop in one background thread, feeding one asyncio stream per request.

The asyncio side (the HTTP server) never touches torch: it hands requests to the
thread through a command queue and receives each step's outputs in one batch on its
event loop. Everything that reads or changes the engine happens on the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..errors import LocalserveError
from .outputs import RequestOutput
from .sampling_params import PoolingParams, SamplingParams
from .stats import EngineStats

if TYPE_CHECKING:
    from ..vision.image_input import ImageInput
    from .engine import Engine

log = logging.getLogger(__name__)

# How often the engine thread refreshes the statistics snapshot while busy, and the
# window its token rates are measured over.
_STATS_INTERVAL_S = 0.25
_RATE_WINDOW_S = 10.0


class QueueFullError(LocalserveError):
    """More requests are waiting than the engine accepts; the client should retry later."""


class EngineDeadError(RuntimeError):
    """The engine failed in a step (a bug or the device, never the request's input)."""


@dataclass(slots=True)
class RequestSnapshot:
    request_id: str
    status: str
    prompt_tokens: int
    output_tokens: int
    age_s: float


class RequestStream:
    """The outputs of one request, in order; the last has ``finished`` set.

    Iterate it with ``async for``; ``close()`` aborts the request if it has not
    finished (a client hung up), which frees its KV blocks within one engine step,
    and ends any iteration waiting on it.
    """

    def __init__(self, request_id: str, owner: AsyncEngine) -> None:
        self.request_id = request_id
        self._owner = owner
        # Outputs, an error from the engine, or None once closed.
        self._queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()
        self.finished = False  # the last output arrived, the engine failed, or closed

    def _put(self, item: RequestOutput | BaseException | None) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self._queue.get()
            # A step can leave several outputs queued; the newest says it all (outputs
            # are cumulative, and its delta takes in the skipped ones'), so a slow
            # client costs one output, not one per step.
            while isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
                newer = self._queue.get_nowait()
                if isinstance(newer, RequestOutput):
                    newer.delta = item.delta + newer.delta
                item = newer
            if item is None:
                return
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item
            if item.finished:
                return

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)
        self._put(None)


class AsyncEngine:
    """Builds an engine on a thread of its own and runs ``engine.step()`` there while
    requests are in flight.

    The model is loaded on that thread too, so every parallel CPU kernel, from the load
    on, runs on one thread's OpenMP team. A second team (left behind by a loading thread)
    makes more OpenMP threads than cores, and libgomp then puts its workers to sleep
    between kernels instead of letting them spin: one stream of a 1B model took 68 ms a
    token instead of 50.

    ``add_request`` must be awaited on the event loop that consumes the streams.
    """

    def __init__(self, make_engine: Callable[[], Engine], max_queued_requests: int = 256, name: str = "engine",
                 footprint: Callable[[Engine], dict[str, int | str]] | None = None) -> None:
        """Returns once the engine is built; raises what building it raised."""
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}  # changed on the engine thread only
        self._num_adding = 0  # requests handed to the thread but not yet accepted (event loop only)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats: EngineStats | None = None  # set once the engine is built, then every interval
        self.requests: list[RequestSnapshot] = []
        self._stats_time = 0.0
        self._token_counts: deque[tuple[float, int, int]] = deque()  # (time, prompt, generated) totals
        built = threading.Event()
        failed: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(make_engine, built, failed),
                                        name=f"localserve-{name}", daemon=True)
        self._thread.start()
        built.wait()
        if failed:
            self._thread.join()
            raise failed[0]
        # What the model holds, for display (see server/footprint.py).
        self.memory = footprint(self.engine) if footprint else {}
        self.max_in_flight = self.engine.config.max_num_seqs + max_queued_requests

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + self._num_adding

    @property
    def dead(self) -> bool:
        """Shut down: nothing more runs here."""
        return self._stopping

    # -- the event-loop side ------------------------------------------------------------

    async def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None,
                          request_id: str | None = None, pooling: PoolingParams | None = None,
                          images: Sequence[ImageInput] = ()) -> RequestStream:
        """Queue a request (with ``pooling``, an embedding; with ``images``, laid out in the
        prompt: see ``Engine.add_request``); raises the engine's LocalserveError when it
        refuses it."""
        if self._stopping:
            raise EngineDeadError("the engine is shut down")
        if self.num_in_flight >= self.max_in_flight:
            raise QueueFullError(f"{self.num_in_flight} requests are in flight, the most this model queues; "
                                 "retry shortly")
        self._loop = loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(request_id, self)
        accepted: asyncio.Future[None] = loop.create_future()

        def add() -> None:
            try:
                self.engine.add_request(prompt_token_ids, params, request_id, pooling, images)
            except Exception as exc:  # LocalserveError (bad input) or a bug: the caller gets it
                loop.call_soon_threadsafe(_settle, accepted, exc)
                return
            self._streams[request_id] = stream
            loop.call_soon_threadsafe(_settle, accepted, None)

        self._num_adding += 1
        self._submit(add)
        try:
            await accepted
        except asyncio.CancelledError:
            stream.finished = True
            self.abort(request_id)  # runs after the add, so nothing is left behind
            raise
        finally:
            self._num_adding -= 1
        return stream

    def abort(self, request_id: str) -> None:
        def abort() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

        self._submit(abort)

    def fail_requests(self, error: BaseException) -> None:
        """End every request in flight with ``error`` (their streams raise it), as soon as
        the current step is done."""
        self._submit(lambda: self._fail_all(error))

    def shutdown(self) -> None:
        """Stop the thread; requests still in flight end with EngineDeadError."""
        self._stopping = True
        self._wake.set()
        self._thread.join()
        self._fail_all(EngineDeadError("the model was unloaded"))

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread ----------------------------------------------------------------

    def _run(self, make_engine: Callable[[], Engine], built: threading.Event, failed: list[BaseException]) -> None:
        try:
            self.engine = make_engine()
            self._refresh_stats(force=True)
        except BaseException as exc:  # handed to the constructor's caller
            failed.append(exc)
            return
        finally:
            built.set()
        while not self._stopping:
            self._apply_commands()
            if not self.engine.has_unfinished_requests():
                self._refresh_stats(force=True)
                # While the rates still count recent tokens, refresh on, so they fall to 0
                # as the window empties instead of freezing at their last busy value.
                self._wake.wait(None if self._rates_settled() else _STATS_INTERVAL_S)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(EngineDeadError(f"the engine failed: {exc}"))
                continue
            self._publish(outputs)
            self._refresh_stats()

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _publish(self, outputs: list[RequestOutput]) -> None:
        deliveries = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            deliveries.append((stream, output))
            if output.finished:
                del self._streams[output.request_id]
        if deliveries and self._loop is not None:
            self._loop.call_soon_threadsafe(_deliver, deliveries)

    def _fail_all(self, error: BaseException) -> None:
        streams = list(self._streams.values())
        self._streams.clear()
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        if streams and self._loop is not None:
            self._loop.call_soon_threadsafe(_deliver, [(stream, error) for stream in streams])

    def _rates_settled(self) -> bool:
        stats = self.stats
        return stats is None or (stats.prompt_tokens_per_s == 0 and stats.generation_tokens_per_s == 0)

    def _refresh_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._stats_time < _STATS_INTERVAL_S:
            return
        self._stats_time = now
        stats = self.engine.stats()
        counts = self._token_counts
        counts.append((now, stats.num_prompt_tokens_total, stats.num_generated_tokens_total))
        while now - counts[0][0] > _RATE_WINDOW_S:
            counts.popleft()
        then, prompt, generated = counts[0]
        elapsed = max(now - then, _STATS_INTERVAL_S)
        # A new frozen snapshot each time: readers on other threads never see one half-built.
        self.stats = replace(
            stats, prompt_tokens_per_s=round((stats.num_prompt_tokens_total - prompt) / elapsed, 1),
            generation_tokens_per_s=round((stats.num_generated_tokens_total - generated) / elapsed, 1))
        self.requests = [
            RequestSnapshot(r.request_id, r.status.value, r.num_prompt_tokens, r.num_output_tokens,
                            round(now - r.arrival_time, 3))
            for r in self.engine.requests.values()
        ]


def _deliver(deliveries: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in deliveries:
        stream._put(item)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
