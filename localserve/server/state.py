"""What the routes share: the server's state, hung on the app."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from starlette.requests import Request

from ..engine.stats import EngineStats
from .config import ServerConfig
from .events import EventLog
from .guard import GuardState
from .metrics import Metrics
from .model_manager import ModelManager


@dataclass
class ServerState:
    config: ServerConfig
    manager: ModelManager
    metrics: Metrics
    guard: GuardState
    events: EventLog
    ready: bool = False  # preloading done
    started_at: float = field(default_factory=time.time)
    device: str = "cpu"  # where models load, and its name (set at start-up)
    device_name: str = ""

    def snapshots(self) -> dict[str, EngineStats]:
        loaded = self.manager.loaded.items()
        return {name: model.engine.stats for name, model in loaded if model.engine.stats is not None}


def state_of(request: Request) -> ServerState:
    return request.app.state.localserve
