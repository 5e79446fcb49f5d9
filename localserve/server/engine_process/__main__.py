"""A model's engine process: ``python -m localserve.server.engine_process --fd N`` builds the engine the
daemon describes in its first frame, then runs it (``AsyncEngine``, as in the daemon's own
process) for the requests the daemon sends, and sends their outputs back.

The daemon starts it before anything else of a load, so torch's import and the model's
load here run on one core while the daemon imports its HTTP stack on the other."""

from __future__ import annotations

import asyncio
import importlib
import logging
import signal
import socket
import sys
import threading
import time
from typing import Any

from ...errors import InsufficientMemoryError
from ...logs import configure_logging
from . import wire

log = logging.getLogger("localserve.server.engine_process")

_STATS_EVERY_S = 0.25
_ENGINE_MODULES = ("localserve.engine.async_engine", "localserve.engine.engine", "localserve.server.footprint",
                   "localserve.server.host")


def main() -> int:
    # The daemon ends this process by closing the socket, once its own drain is done: a
    # Ctrl-C that reaches the terminal's whole process group must not end it first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fd = int(sys.argv[sys.argv.index("--fd") + 1])
    sock = socket.socket(fileno=fd)
    # torch and the engine first: a spare process (started before the daemon imports its
    # own modules) is ready to load the moment the daemon names a model.
    for module in _ENGINE_MODULES:
        importlib.import_module(module)

    while True:
        try:
            load = wire.receive(sock)
        except wire.ConnectionClosed:  # the daemon ended before it needed this process
            return 0
        configure_logging(load["log_level"])
        try:
            running = _build(sock, load)
            break
        except Exception as exc:  # noqa: BLE001  # told to the daemon in one line; it decides what to show
            error = wire.error_to_wire(exc)
            if error["kind"] == "engine":
                log.exception("loading %s failed", load["path"])
            # Refused for want of memory before anything was allocated, this process (torch
            # imported) takes the load the daemon retries once it has unloaded a model: the
            # daemon keeps it as its spare meanwhile.
            reusable = isinstance(exc, _NoRoom)
            _send_quietly(sock, {"op": "failed", "reusable": reusable, **error})
            if not reusable:
                return 1
    try:
        asyncio.run(_serve(sock, running))
    except OSError:  # the daemon went away mid-send: nothing is left to answer
        pass
    return 0


def _send_quietly(sock: socket.socket, message: dict[str, Any]) -> None:
    try:
        wire.send(sock, message)
    except OSError:
        pass


def _build(sock: socket.socket, load: dict[str, Any]) -> Any:
    """The engine the daemon described, built on the AsyncEngine's thread; how far the load
    has got goes to the daemon every quarter second (its dashboard shows it)."""
    from ...engine.async_engine import AsyncEngine
    from ...engine.engine import build_engine
    from ...engine.stats import LoadProgress
    from ..footprint import memory_footprint

    config = wire.engine_config_from_wire(load["config"])
    if load["check_room"]:
        _check_room(load, config)
    progress = LoadProgress()
    built = threading.Event()

    def report() -> None:
        while not built.wait(_STATS_EVERY_S):
            _send_quietly(sock, {"op": "progress", "phase": progress.phase, "done": progress.done,
                                 "total": progress.total})

    reporter = threading.Thread(target=report, name="localserve-load-progress", daemon=True)
    reporter.start()
    try:
        return AsyncEngine(lambda: build_engine(load["path"], config, load["device"], load["dtype"], progress,
                                                load["name"]),
                           load["max_queued_requests"], load["name"], memory_footprint)
    finally:
        built.set()
        reporter.join()


class _NoRoom(InsufficientMemoryError):
    """The load would not fit the host memory available; refused before anything was allocated."""


def _check_room(load: dict[str, Any], config: Any) -> None:
    from ...engine.host_memory import available_host_memory
    from ..footprint import needed_bytes

    needed = needed_bytes(load["path"], config, load["device"], load["dtype"])
    available = available_host_memory().available
    if needed is not None and needed > available:
        raise _NoRoom(f"loading {load['name']} needs ~{needed >> 20} MiB, {available >> 20} MiB are available")


async def _serve(sock: socket.socket, engine: Any) -> None:
    from ...kernels import cpu_library
    from ..host import device_name

    loop = asyncio.get_running_loop()
    inner = engine.engine
    wire.send(sock, {
        "op": "loaded", "clock": time.monotonic(), "max_model_len": inner.max_model_len,
        "memory": engine.memory,
        "kv_tokens": inner.kv.device.num_blocks * inner.config.block_size,
        "cpu_kv_tokens": inner.kv.cpu.num_blocks * inner.config.block_size,
        "kv_dtype": str(inner.kv_dtype).removeprefix("torch."), "device_name": device_name(str(inner.device)),
        "cpu_kernels": cpu_library.variant() if inner.device.type == "cpu" and inner.kernels.cpu_kernels else None,
    })
    commands: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    loop.run_in_executor(None, _read_commands, sock, loop, commands)
    forwards: dict[str, asyncio.Task[None]] = {}
    stats = asyncio.create_task(_send_stats(sock, engine))
    try:
        while (command := await commands.get()) is not None:
            if command["op"] == "add":
                forwards[command["id"]] = asyncio.create_task(_forward(sock, engine, command, forwards))
            elif command["op"] == "abort":
                task = forwards.pop(command["id"], None)
                if task is not None:
                    task.cancel()
                engine.abort(command["id"])
            elif command["op"] == "shutdown":
                break
    finally:
        stats.cancel()
        engine.shutdown()


def _read_commands(sock: socket.socket, loop: asyncio.AbstractEventLoop,
                   commands: asyncio.Queue[dict[str, Any] | None]) -> None:
    try:
        while True:
            loop.call_soon_threadsafe(commands.put_nowait, wire.receive(sock))
    except (wire.ConnectionClosed, OSError):  # the daemon is gone: so is this process's reason to be
        loop.call_soon_threadsafe(commands.put_nowait, None)


async def _forward(sock: socket.socket, engine: Any, command: dict[str, Any],
                   forwards: dict[str, asyncio.Task[None]]) -> None:
    request_id = command["id"]
    try:
        stream = await engine.add_request(command["prompt"], wire.sampling_params_from_wire(command["params"]),
                                          request_id, wire.pooling_from_wire(command["pooling"]),
                                          wire.images_from_wire(command.get("images") or []))
    except Exception as exc:  # noqa: BLE001  # every refusal goes back to the waiting request
        wire.send(sock, {"op": "rejected", "id": request_id, **wire.error_to_wire(exc)})
        forwards.pop(request_id, None)
        return
    wire.send(sock, {"op": "accepted", "id": request_id})
    sent_tokens = sent_logprobs = 0
    try:
        async for output in stream:
            wire.send(sock, {"op": "output", **wire.output_to_wire(output, sent_tokens, sent_logprobs)})
            sent_tokens, sent_logprobs = len(output.token_ids), len(output.logprobs or ())
    except Exception as exc:  # noqa: BLE001  # the engine failed the request (EngineDeadError)
        wire.send(sock, {"op": "failed_request", "id": request_id, "error": str(exc)})
    finally:
        stream.close()
        forwards.pop(request_id, None)


async def _send_stats(sock: socket.socket, engine: Any) -> None:
    import dataclasses

    last = None
    while True:
        snapshot = (engine.stats, engine.requests)
        if snapshot != last:
            last = snapshot
            wire.send(sock, {"op": "stats", "stats": engine.stats.as_dict() if engine.stats else None,
                             "requests": [dataclasses.asdict(r) for r in engine.requests]})
        await asyncio.sleep(_STATS_EVERY_S)


if __name__ == "__main__":
    sys.exit(main())
