"""The daemon's side of a model's engine process: ``RemoteEngine`` answers as the in-process
``AsyncEngine`` does (``add_request`` gives a ``RequestStream``; ``abort``, ``stats``,
``requests``, ``memory``, ``shutdown``), so the model manager and the routes cannot tell
them apart. Imports no torch: the daemon with every model in its own process never does."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...engine.async_engine import EngineDeadError, RequestSnapshot, RequestStream
from ...engine.config import EngineConfig
from ...engine.outputs import RequestOutput
from ...engine.sampling_params import PoolingParams, SamplingParams
from ...engine.stats import EngineStats, LoadProgress
from ...formats import open_checkpoint
from ...vision.image_input import ImageInput
from . import wire
from .spawn import keep_as_spare, spawn, take_spare

log = logging.getLogger(__name__)

_EXIT_WAIT_S = 10.0


@dataclasses.dataclass
class EngineFacts:
    """What the daemon reads of a loaded engine (``LoadedModel``, the start-up summary):
    the same names as ``Engine``'s, filled from the checkpoint read here and the figures
    the engine process sent once it was built."""

    checkpoint: Any
    tokenizer: Any
    config: EngineConfig
    max_model_len: int
    kv_tokens: int
    cpu_kv_tokens: int
    kv_dtype: str

    @property
    def spec(self) -> Any:
        return self.checkpoint.spec


class RemoteEngine:
    """A model's engine in a process of its own. Building one starts the process (or takes
    the spare) and returns once it has loaded the model, raising what the load raised;
    ``check_room``: the process first refuses (InsufficientMemoryError) a load that would not
    fit in the host memory available."""

    def __init__(self, path: Path, name: str, config: EngineConfig, device: str | None, dtype: str | None,
                 max_queued_requests: int, progress: LoadProgress, check_room: bool = False) -> None:
        progress.step("starting the engine process")
        self._process, self._sock = take_spare() or spawn()
        self._send_lock = threading.Lock()
        log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel())  # the daemon's, for its logs
        try:
            self._send({"op": "load", "path": str(path), "name": name, "device": device, "dtype": dtype,
                        "max_queued_requests": max_queued_requests, "log_level": log_level,
                        "check_room": check_room, "config": wire.engine_config_to_wire(config)})
            # The checkpoint's metadata and tokenizer, for the HTTP side, read while the
            # engine process imports torch and loads.
            checkpoint = open_checkpoint(path)
            tokenizer = checkpoint.check_loadable()
            progress.step("loading in the engine process")
            while (loaded := wire.receive(self._sock))["op"] == "progress":
                progress.phase, progress.done, progress.total = loaded["phase"], loaded["done"], loaded["total"]
        except wire.ConnectionClosed:  # killed (out of memory?) or crashed while it loaded
            self._end_process()  # it is ending: wait for its exit status
            raise RuntimeError(f"the engine process ended while loading {name} "
                               f"(exit status {self._process.returncode})") from None
        except BaseException:
            self._end_process(wait=False)
            raise
        if loaded["op"] == "failed":
            # A process that refused the load before allocating anything (too little memory)
            # is kept as the spare: the manager unloads a model and retries with it.
            if not (loaded["reusable"] and keep_as_spare(self._process, self._sock)):
                self._end_process()
            raise wire.error_from_wire(loaded, engine_error=_EngineLoadError)
        self.engine = EngineFacts(checkpoint, tokenizer, config, loaded["max_model_len"], loaded["kv_tokens"],
                                  loaded["cpu_kv_tokens"], loaded["kv_dtype"])
        self.memory: dict[str, int | str] = loaded["memory"]
        self.device_name: str = loaded["device_name"]
        self.cpu_kernels: str | None = loaded["cpu_kernels"]  # the CPU kernels' build, for the start-up summary
        self._clock_offset = time.monotonic() - loaded["clock"]  # the same clock on Linux; kept honest anyway
        self.stats: EngineStats | None = None
        self.requests: list[RequestSnapshot] = []
        self._streams: dict[str, tuple[RequestStream, list[int], list[RequestOutput | None]]] = {}
        self._pending: dict[str, asyncio.Future[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None
        self._reader = threading.Thread(target=self._read, name=f"localserve-{name}-reader", daemon=True)
        self._reader.start()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + len(self._pending)

    @property
    def dead(self) -> bool:
        """The engine process has ended (or was shut down): nothing more runs here."""
        return self._dead is not None

    async def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None,
                          request_id: str | None = None, pooling: PoolingParams | None = None,
                          images: Sequence[ImageInput] = ()) -> RequestStream:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        self._loop = loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(request_id, self)  # type: ignore[arg-type]
        accepted = self._pending[request_id] = loop.create_future()
        self._streams[request_id] = (stream, list(prompt_token_ids), [None])
        try:
            self._send({"op": "add", "id": request_id, "prompt": prompt_token_ids,
                        "pooling": wire.pooling_to_wire(pooling), "images": wire.images_to_wire(images),
                        "params": wire.sampling_params_to_wire(params or SamplingParams())})
            await accepted
        except asyncio.CancelledError:
            stream.finished = True
            self.abort(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finally:
            self._pending.pop(request_id, None)
        return stream

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if self._dead is None:
            try:
                self._send({"op": "abort", "id": request_id})
            except EngineDeadError:
                pass  # the process is gone, and the request with it

    def fail_requests(self, error: BaseException) -> None:
        for request_id, (stream, _, _) in list(self._streams.items()):
            self.abort(request_id)
            stream._put(error)

    def shutdown(self) -> None:
        if self._dead is None:
            self._dead = "the model was unloaded"
            try:
                self._send({"op": "shutdown"})
            except EngineDeadError:
                pass
        self._end_process()
        self._fail_all(EngineDeadError("the model was unloaded"))

    # -- the reader thread ------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                message = wire.receive(self._sock)
                if message["op"] == "stats":
                    self.stats = wire.stats_from_wire(message["stats"])
                    self.requests = [RequestSnapshot(**r) for r in message["requests"]]
                elif self._loop is not None:
                    self._loop.call_soon_threadsafe(self._handle, message)
        except (wire.ConnectionClosed, OSError):
            pass
        if self._dead is None:
            code = self._process.poll()
            self._dead = f"the model's engine process ended{'' if code is None else f' (exit status {code})'}"
            log.error("%s", self._dead)
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(self._dead))

    def _handle(self, message: dict[str, Any]) -> None:
        """On the event loop: one message about one request."""
        request_id = message["id"]
        op = message["op"]
        if op in ("accepted", "rejected"):
            future = self._pending.get(request_id)
            if future is not None and not future.done():
                future.set_result(None) if op == "accepted" else future.set_exception(wire.error_from_wire(message))
            return
        entry = self._streams.get(request_id)
        if entry is None:
            return  # aborted meanwhile
        stream, prompt, last = entry
        if op == "failed_request":
            del self._streams[request_id]
            stream._put(EngineDeadError(message["error"]))
            return
        output = wire.output_from_wire(message, last[0], prompt, self._clock_offset)
        last[0] = output
        if output.finished:
            del self._streams[request_id]
        stream._put(dataclasses.replace(output))  # the stream may merge deltas into its copy

    def _fail_all(self, error: BaseException) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        for stream, _, _ in self._streams.values():
            stream._put(error)
        self._streams.clear()

    def _send(self, message: dict[str, Any]) -> None:
        """Raises EngineDeadError when the process has gone (before the reader has noticed)."""
        with self._send_lock:
            try:
                wire.send(self._sock, message)
            except OSError as exc:
                raise EngineDeadError(f"the model's engine process ended ({exc.strerror or exc})") from None

    def _end_process(self, wait: bool = True) -> None:
        """Close the socket, which ends the process once it has let go of its model (a
        process mid-load is killed: it would load on to no end)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # a close alone would wait on the reader thread's recv
        except OSError:
            pass  # the process has closed its end already
        self._sock.close()
        try:
            self._process.wait(_EXIT_WAIT_S if wait else 0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


class _EngineLoadError(RuntimeError):
    """The engine process failed to load for a reason of its own (a bug, the device)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"the engine process failed: {message}")
