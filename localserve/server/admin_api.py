"""localserve's own admin API (/api/localserve/...) the CLI and dashboard use beside
Ollama's routes, /health and /metrics."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from .. import __version__
from .host import host_stats
from .model_manager import parse_keep_alive
from .ollama_models import iso, loaded_model
from .protocol import LoadRequest, UnloadRequest
from .state import state_of

router = APIRouter()


@router.post("/api/localserve/load")
async def load(request: Request, body: LoadRequest) -> dict[str, Any]:
    model = await state_of(request).manager.load(body.model, keep_alive=parse_keep_alive(body.keep_alive))
    return await loaded_model(request, model)


@router.post("/api/localserve/unload")
async def unload(request: Request, body: UnloadRequest) -> dict[str, Any]:
    manager = state_of(request).manager
    name = manager.loaded_name(body.model)  # 404 when unknown
    return {"model": name, "unloaded": await manager.unload(name)}


@router.get("/api/localserve/stats")
async def stats(request: Request) -> dict[str, Any]:
    """Everything the dashboard shows, per loaded model."""
    state = state_of(request)
    await state.manager.check_registry()  # what changed since the watcher last looked shows now
    models = []
    for model in list(state.manager.loaded.values()):
        models.append({
            **await loaded_model(request, model),
            **model.description(),
            "engine": model.engine.stats.as_dict() if model.engine.stats is not None else {},
            "requests": [dataclasses.asdict(r) for r in model.engine.requests],
            "recent": state.metrics.recent_summary(model.name),
        })
    known = state.manager.names()
    loading = [{"name": name, **progress.as_dict(), "requests_waiting": state.manager.waiting.get(name, 0)}
               for name, progress in list(state.manager.load_progress.items())]
    return {"version": __version__, "ready": state.ready, "draining": state.guard.draining,
            "started_at": iso(state.started_at), "uptime_s": round(time.time() - state.started_at, 1),
            "host": host_stats(state.device, state.device_name),
            "known_models": known, "models": models, "loading": loading, "events": state.events.recent()}


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
