"""Runs the app under uvicorn: one listener, SIGTERM drains before exiting 0."""

from __future__ import annotations

import logging
import time

import uvicorn

from ..errors import LocalserveError
from .app import ServerConfig, create_app
from .guard import GuardState, is_loopback

log = logging.getLogger(__name__)

# After the drain, how long uvicorn waits for connections that are still open.
_CLOSE_GRACE_S = 5


class DrainingServer(uvicorn.Server):
    """The first SIGTERM/SIGINT stops taking requests (503) and lets those running
    finish, up to the drain timeout; a second one exits at once."""

    def __init__(self, config: uvicorn.Config, guard: GuardState, drain_timeout: float) -> None:
        super().__init__(config)
        self.guard = guard
        self.drain_timeout = drain_timeout
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: object) -> None:
        if self.guard.draining:
            self.should_exit = self.force_exit = True
            return
        log.info("signal %d: draining (%d requests in flight, at most %.0f s)", sig, self.guard.in_flight,
                 self.drain_timeout)
        self.guard.draining = True
        self.drain_deadline = time.monotonic() + self.drain_timeout
        # Not uvicorn's handler: it would re-raise the signal after shutting down, and
        # the process would end by the signal instead of exiting 0.

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            if self.guard.in_flight == 0 or time.monotonic() >= self.drain_deadline:
                self.should_exit = True
        return await super().on_tick(counter)


def check_bind(host: str, api_key: str | None, insecure_no_auth: bool) -> None:
    """Refuse to serve a non-loopback address without an API key, unless told to."""
    if not is_loopback(host) and not api_key and not insecure_no_auth:
        raise LocalserveError(
            f"refusing to listen on {host} without an API key: anyone who can reach it could use it. "
            "Set --api-key (or LOCALSERVE_API_KEY), or pass --insecure-no-auth if the network is trusted")


def serve(config: ServerConfig, insecure_no_auth: bool = False, log_level: str = "info") -> int:
    """Serve until SIGTERM; returns the exit status."""
    check_bind(config.host, config.api_key, insecure_no_auth)
    app = create_app(config)
    uvicorn_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                                    timeout_graceful_shutdown=_CLOSE_GRACE_S, access_log=False,
                                    server_header=False)
    server = DrainingServer(uvicorn_config, app.state.localserve.guard, config.drain_timeout)
    server.run()
    return 0 if server.started else 1
