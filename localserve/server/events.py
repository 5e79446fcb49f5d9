"""The daemon's recent events (loads, unloads, failures, registry changes), for the
dashboard: a bounded log whose entries carry an increasing ``seq``, so a client that
polls shows each one once."""

from __future__ import annotations

import datetime as dt
import itertools
import logging
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("localserve.events")
_KEPT = 100


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    time: str  # ISO 8601, UTC
    kind: str  # load, unload, load_failed, error, pull, remove
    model: str | None
    message: str


class EventLog:
    def __init__(self) -> None:
        self._events: deque[Event] = deque(maxlen=_KEPT)
        self._seq = itertools.count(1)
        self._registered: set[str] | None = None  # the registry's names when last looked at

    def add(self, kind: str, model: str | None, message: str) -> None:
        now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        self._events.append(Event(next(self._seq), now, kind, model, message))
        log.info("%s %s: %s", kind, model or "-", message)

    def recent(self) -> list[dict[str, Any]]:
        return [asdict(event) for event in self._events]

    def note_registry(self, names: list[str]) -> None:
        """Log the models pulled or removed since the last look (the CLI changes the
        registry; the daemon only sees the result)."""
        current = set(names)
        if self._registered is not None:
            for name in sorted(current - self._registered):
                self.add("pull", name, "appeared in the registry")
            for name in sorted(self._registered - current):
                self.add("remove", name, "removed from the registry")
        self._registered = current
