"""Where the dashboard's numbers come from: the daemon's admin API (or, in tests, a script)."""

from __future__ import annotations

from typing import Any, Protocol

from ..client import DaemonClient


class StatsSource(Protocol):
    """Blocking calls (the app runs them in a thread). Errors propagate: ``DaemonError``
    when the daemon answers with one (401: the API key), ``LocalserveError`` when it
    cannot be reached; the app decides what each means on screen."""

    def stats(self) -> dict[str, Any]: ...

    def unload(self, name: str) -> dict[str, Any]: ...


class HttpStatsSource:
    def __init__(self, client: DaemonClient) -> None:
        self.client = client

    @property
    def url(self) -> str:
        return self.client.url

    def stats(self) -> dict[str, Any]:
        answer = self.client.get("/api/localserve/stats")
        if not isinstance(answer, dict):
            raise ValueError(f"/api/localserve/stats answered {type(answer).__name__}, not an object")
        return answer

    def unload(self, name: str) -> dict[str, Any]:
        return self.client.post("/api/localserve/unload", {"model": name})
