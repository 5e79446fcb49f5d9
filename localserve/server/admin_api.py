"""The admin API (/api/...) the CLI and dashboard use, /health and /metrics."""

from __future__ import annotations

import dataclasses
import datetime as dt
import platform
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from .. import __version__
from .host import host_stats
from .model_manager import LoadedModel, parse_keep_alive
from .protocol import LoadRequest, UnloadRequest
from .state import state_of

router = APIRouter()


def _iso(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return dt.datetime.fromtimestamp(timestamp, dt.timezone.utc).isoformat(timespec="seconds")


def _keep_alive_seconds(model: LoadedModel) -> float | None:
    return None if model.keep_alive == float("inf") else model.keep_alive


def _running_model(model: LoadedModel) -> dict[str, Any]:
    return {
        "name": model.name,
        "path": str(model.path),
        "loaded_at": _iso(model.loaded_at),
        "expires_at": _iso(model.expires_wall()),  # null: in use, or kept loaded forever
        "keep_alive_s": _keep_alive_seconds(model),
        "requests_in_flight": model.engine.num_in_flight,
        "max_model_len": model.max_model_len,
        "memory": model.engine.memory,
    }


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    """Loaded models, their memory on the device and in host RAM, and when they expire."""
    manager = state_of(request).manager
    return {"models": [_running_model(model) for model in manager.loaded.values()],
            "loading": [name for name in manager.names() if manager.is_loading(name)]}


@router.post("/api/load")
async def load(request: Request, body: LoadRequest) -> dict[str, Any]:
    model = await state_of(request).manager.load(body.model, keep_alive=parse_keep_alive(body.keep_alive))
    return _running_model(model)


@router.post("/api/unload")
async def unload(request: Request, body: UnloadRequest) -> dict[str, Any]:
    manager = state_of(request).manager
    name = manager.loaded_name(body.model)  # 404 when unknown
    return {"model": name, "unloaded": await manager.unload(name)}


@router.get("/api/stats")
async def stats(request: Request) -> dict[str, Any]:
    """Everything the dashboard shows, per loaded model."""
    state = state_of(request)
    models = []
    for model in state.manager.loaded.values():
        models.append({
            **_running_model(model),
            **model.description(),
            "engine": model.engine.stats.as_dict() if model.engine.stats is not None else {},
            "requests": [dataclasses.asdict(r) for r in model.engine.requests],
            "recent": state.metrics.recent_summary(model.name),
        })
    known = state.manager.names()
    state.events.note_registry([name for name in known if name not in state.config.models])
    return {"version": __version__, "ready": state.ready, "draining": state.guard.draining,
            "started_at": _iso(state.started_at), "uptime_s": round(time.time() - state.started_at, 1),
            "host": host_stats(state.device, state.device_name),
            "known_models": known, "models": models, "events": state.events.recent()}


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": __version__, "python": platform.python_version()}


@router.get("/health")
async def health(request: Request) -> Response:
    state = state_of(request)
    if state.guard.draining:
        return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "5"})
    if not state.ready:
        return JSONResponse({"status": "starting"}, status_code=503, headers={"Retry-After": "2"})
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(state_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
