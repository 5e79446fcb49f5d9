"""Runs the app under uvicorn: one listener; SIGTERM drains before exiting 0, SIGHUP
reloads the model list, and systemd hears of each (sd_notify)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from ..engine.async_engine import EngineDeadError
from ..errors import LocalserveError
from .app import create_app
from .config import ServerConfig
from .engine_process.spawn import start_spare
from .guard import ASGIApp, is_loopback
from .slow_clients import SlowClientProtocol
from .startup import log_startup_summary
from .state import ServerState
from .systemd import SystemdNotifier

log = logging.getLogger(__name__)

# After the drain, how long uvicorn waits for connections that are still open.
_CLOSE_GRACE_S = 5
# Beyond the drain and the grace: unloading models and exiting.
_EXIT_S = 10
# uvicorn calls on_tick every 0.1 s; the STATUS line shown by `systemctl status` is
# refreshed every this many ticks.
_STATUS_EVERY_TICKS = 20
# With engine processes, a spare one (torch imported, the next load's to take) is started
# once the daemon has run no request and no load for this many ticks: its import beside a
# running request would slow that request on a small machine.
_SPARE_AFTER_IDLE_TICKS = 20

ModelList = Callable[[], dict[str, Path]]


class DrainingServer(uvicorn.Server):
    """The first SIGTERM/SIGINT stops taking requests (503) and lets those running
    finish, up to the drain timeout; a second one ends those still running at once, each
    with an error (as the drain timeout does), and exits; a third exits without waiting for
    them. SIGHUP calls ``model_list`` and serves what it returns."""

    def __init__(self, config: uvicorn.Config, state: ServerState, notifier: SystemdNotifier,
                 model_list: ModelList | None = None) -> None:
        super().__init__(config)
        self.state = state
        self.guard = state.guard
        self.notifier = notifier
        self.model_list = model_list
        self.drain_timeout = state.config.drain_timeout
        self.drain_deadline: float | None = None
        self.end_now = False  # a second signal: end the requests still running at the next tick
        self.reload_requested = False
        self._reload: asyncio.Task[None] | None = None
        self._loads: set[asyncio.Task[None]] = set()  # models loading after a reload
        self._announced = False
        self._summarized = False  # the start-up summary, logged once the preloads are done
        self._status = ""
        self._idle_ticks = 0

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        # SIGHUP would otherwise end the process (its default action).
        previous = signal.signal(signal.SIGHUP, self._request_reload)
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(signal.SIGHUP, previous)

    def _request_reload(self, sig: int, frame: object) -> None:
        self.reload_requested = True  # acted on in the event loop, at the next tick

    def handle_exit(self, sig: int, frame: object) -> None:
        if self.guard.draining:
            # Not uvicorn's force exit at the second signal (a second Ctrl-C is common): it
            # cuts streams mid-event and its cancelled tasks log tracebacks. The requests
            # end in the event loop, at the next tick (not here, in a signal handler).
            if self.end_now:
                self.should_exit = self.force_exit = True
            else:
                self.end_now = True
                self.drain_deadline = time.monotonic()
            return
        log.info("signal %d: draining (%d requests in flight, at most %.0f s)", sig, self.guard.in_flight,
                 self.drain_timeout)
        self.guard.draining = True
        self.drain_deadline = time.monotonic() + self.drain_timeout
        self.notifier.stopping(f"draining {self.guard.in_flight} requests",
                               self.drain_timeout + _CLOSE_GRACE_S + _EXIT_S)
        # Not uvicorn's handler: it would re-raise the signal after shutting down, and
        # the process would end by the signal instead of exiting 0.

    async def on_tick(self, counter: int) -> bool:
        if not self._announced:  # the first tick comes once the listener is up
            self._announced = True
            ollama = self.state.config.ollama_port
            self.notifier.ready(f"listening on {self.config.host}:{self.config.port}"
                                + (f" and :{ollama} (Ollama's port)" if ollama is not None else ""))
        if not self._summarized and self.state.ready:
            self._summarized = True
            self._log_summary()
        self.notifier.watchdog_tick()
        if self.reload_requested and not self.guard.draining and self._reload is None:
            self.reload_requested = False
            self._reload = asyncio.get_running_loop().create_task(self._reload_models())
        if counter % _STATUS_EVERY_TICKS == 0 and not self.guard.draining:
            self._update_status()
        if self.state.config.engine_processes:
            self._keep_a_spare()
        if self.drain_deadline is not None and not self.should_exit:
            if self.guard.in_flight == 0:
                self.should_exit = True
            elif time.monotonic() >= self.drain_deadline:
                self._end_requests()
                self.should_exit = True  # uvicorn waits for the ended streams to close
        return await super().on_tick(counter)

    def _log_summary(self) -> None:
        # The ports as bound (a port of 0 in the config means any free one).
        ports = [self.config.port, self.state.config.ollama_port]
        for index, server in enumerate(self.servers[:2]):
            sockets = getattr(server, "sockets", None) or []
            if sockets and isinstance(name := sockets[0].getsockname(), tuple):
                ports[index] = name[1]
        log_startup_summary(self.state, self.config.host, int(ports[0] or 0),
                            ports[1] if self.state.config.ollama_port is not None else None)

    def _end_requests(self) -> None:
        """The drain timed out, or a second signal came: every request still running ends
        now with an error (a stream with an error event and [DONE]), not a cut connection."""
        if self.end_now:
            why, reason = "a second signal", "it was told to stop at once"
        else:
            why, reason = "drain timeout", f"its drain timeout ({self.drain_timeout:g} s) passed"
        log.warning("%s: ending %d requests in flight", why, self.guard.in_flight)
        error = EngineDeadError(f"the server is shutting down: {reason} before this response finished")
        for model in list(self.state.manager.loaded.values()):
            model.engine.fail_requests(error)

    async def _reload_models(self) -> None:
        self.notifier.reloading()
        try:
            if self.model_list is None:
                log.info("SIGHUP: the model list comes from the command line or environment; nothing to reload")
            else:
                sources = await asyncio.to_thread(self.model_list)
                changed = await self.state.manager.replace_sources(sources)
                for name in changed:
                    task = asyncio.get_running_loop().create_task(_load_quietly(self.state, name))
                    self._loads.add(task)  # the loop keeps only weak references to tasks
                    task.add_done_callback(self._loads.discard)
        except Exception as exc:  # a broken config file must not take the daemon down
            log.error("SIGHUP: could not reload the model list, keeping the current one: %s", exc)
        finally:
            self._reload = None
            self.notifier.ready(self._status_line())

    def _keep_a_spare(self) -> None:
        busy = self.guard.in_flight or self.state.manager.load_progress or self.guard.draining
        self._idle_ticks = 0 if busy else self._idle_ticks + 1
        if self._idle_ticks >= _SPARE_AFTER_IDLE_TICKS:
            start_spare()  # nothing when there is one

    def _update_status(self) -> None:
        status = self._status_line()
        if status != self._status:
            self._status = status
            self.notifier.status(status)

    def _status_line(self) -> str:
        return (f"{'ready' if self.state.ready else 'preloading'}: models loaded {len(self.state.manager.loaded)}, "
                f"requests in flight {self.guard.in_flight}")


async def _load_quietly(state: ServerState, name: str) -> None:
    try:
        await state.manager.load(name)
    except Exception as exc:
        log.error("could not load %s after the reload: %s", name, exc)


def check_bind(host: str, api_key: str | None, insecure_no_auth: bool) -> None:
    """Refuse to serve a non-loopback address without an API key, unless told to; told
    to, say so in the log, where whoever reads it later will look."""
    if is_loopback(host) or api_key:
        return
    if not insecure_no_auth:
        raise LocalserveError(
            f"refusing to listen on {host} without an API key: anyone who can reach it could use it. "
            "Set --api-key (or LOCALSERVE_API_KEY), or pass --insecure-no-auth if the network is trusted")
    log.warning("listening on %s without an API key (--insecure-no-auth): anyone who can reach this "
                "address can use every model and the admin API", host)


def listener_config(app: ASGIApp, config: ServerConfig, port: int, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's settings for one listener of ``app``: slow clients are cut off
    (slow_clients.py) and connections capped."""
    return uvicorn.Config(
        app, host=config.host, port=port, log_level=log_level,
        log_config=None,  # uvicorn's loggers go to the handler configure_logging set up
        timeout_graceful_shutdown=_CLOSE_GRACE_S, access_log=False, server_header=False,
        http=SlowClientProtocol.with_timeouts(config.header_timeout, config.body_timeout),
        # uvicorn answers a request with 503 (and closes) when its connection is the
        # limit_concurrency-th one open (it counts itself) or limit_concurrency requests
        # already run: + 1 serves exactly max_connections connections. A stream holds its
        # connection while it runs and counts as one, as does an idle kept-alive one: the
        # cap is on sockets, what a flood of clients exhausts, not on work, which has its
        # own, earlier limit: a model queues --max-queued-requests beyond its batch and
        # answers 429 past that (as Ollama's OLLAMA_MAX_QUEUE answers 503; vLLM has no
        # cap). So the default 1024 sits above what the default engines take at once,
        # 3 models x (64 running + 256 queued): clients meet the queue's 429 first.
        limit_concurrency=config.max_connections + 1)


def serve(config: ServerConfig, insecure_no_auth: bool = False, log_level: str = "info",
          model_list: ModelList | None = None) -> int:
    """Serve until SIGTERM; returns the exit status. ``model_list`` gives the named
    models anew on SIGHUP (None: they came from the command line and stay)."""
    check_bind(config.host, config.api_key, insecure_no_auth)
    app = create_app(config)
    uvicorn_config = listener_config(app, config, config.port, log_level)
    notifier = SystemdNotifier()
    server = DrainingServer(uvicorn_config, app.state.localserve, notifier, model_list)
    # Both listeners are bound before serving, so a port in use fails at start. The server
    # runs both sockets with the first config (one protocol, one count of connections);
    # the second only binds, with the same settings.
    sockets = [uvicorn_config.bind_socket()]
    if config.ollama_port is not None:
        sockets.append(listener_config(app, config, config.ollama_port, log_level).bind_socket())
    try:
        server.run(sockets=sockets)
    finally:
        notifier.close()
    return 0 if server.started else 1
