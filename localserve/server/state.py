"""What the routes share: the server's state, hung on the app."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request

from .guard import GuardState
from .metrics import Metrics
from .model_manager import ModelManager

if TYPE_CHECKING:
    from .app import ServerConfig


@dataclass
class ServerState:
    config: ServerConfig
    manager: ModelManager
    metrics: Metrics
    guard: GuardState
    ready: bool = False  # preloading done

    def snapshots(self) -> dict[str, dict]:
        return {name: model.engine.stats for name, model in self.manager.loaded.items()}


def state_of(request: Request) -> ServerState:
    return request.app.state.localserve
