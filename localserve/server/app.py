"""The FastAPI application: the daemon's one HTTP listener.

``create_app(config)`` wires the model manager, metrics, the guard middleware and the
routers together; ``serve.py`` runs it under uvicorn with SIGTERM draining.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from .. import __version__
from ..engine.async_engine import AsyncEngine
from ..engine.stats import LoadProgress
from ..errors import LocalserveError
from . import admin_api, anthropic_api, embeddings, errors, ollama_api, ollama_models, openai_api
from .guard import Guard, GuardState, is_loopback
from .metrics import Metrics
from .catalog import CatalogEntry, ModelCatalog
from .events import EventLog
from .config import ServerConfig
from .model_manager import Loader, ManagerOptions, ModelManager
from .state import ServerState

log = logging.getLogger(__name__)

# What the anthropic SDK sends from a browser: its key, API version and beta flags, and
# the header it needs to run in one at all.
ANTHROPIC_HEADERS = ["x-api-key", "anthropic-version", "anthropic-beta", "anthropic-dangerous-direct-browser-access"]


def open_engine(config: ServerConfig, others_loaded: Callable[[], bool] = lambda: False) -> Loader:
    """The manager's loader: with ``engine_processes`` a RemoteEngine (the engine in a process
    of its own), else an AsyncEngine, which builds its Engine on its own thread; either way
    the calling worker thread waits for the load, which reports into ``progress``. An engine
    process checks, while ``others_loaded``, that the load fits in the memory available (the
    manager then unloads an idle model and tries again), as the manager does for a thread."""

    def load(entry: CatalogEntry, progress: LoadProgress) -> AsyncEngine:
        from dataclasses import replace

        # A model's own num_ctx (its Modelfile's) sets its context, in place of the server's.
        engine_config = config.engine if entry.settings.context_length is None else \
            replace(config.engine, max_model_len=entry.settings.context_length)
        if config.engine_processes:
            from .engine_process.remote import RemoteEngine

            return RemoteEngine(entry.path, entry.name, engine_config, config.device, config.dtype,  # type: ignore[return-value]
                                config.max_queued_requests, progress, check_room=others_loaded())

        from ..engine.engine import build_engine
        from .footprint import memory_footprint

        return AsyncEngine(lambda: build_engine(entry.path, engine_config, config.device, config.dtype, progress,
                                                entry.name),
                           config.max_queued_requests, entry.name, memory_footprint)

    return load


def create_app(config: ServerConfig, load: Loader | None = None) -> FastAPI:
    """The app for ``config``; ``load`` replaces the engine loader (tests)."""
    def needed_bytes(path: Path) -> int | None:
        from .footprint import needed_bytes  # torch: imported when a model loads beside another

        return needed_bytes(path, config.engine, config.device, config.dtype)

    # Engine processes estimate a load's memory themselves (torch stays out of the daemon).
    options = ManagerOptions(default_keep_alive=config.keep_alive, max_loaded_models=config.max_loaded_models,
                             needed_bytes=(lambda path: None) if config.engine_processes else needed_bytes)
    events = EventLog()
    catalog = ModelCatalog(config.models, config.registry_home)
    manager = ModelManager(catalog, load or open_engine(config, lambda: bool(manager.loaded)), options, events)
    guard = GuardState(api_key=config.api_key, loopback_only=is_loopback(config.host),
                       max_body_bytes=config.max_body_bytes)
    state = ServerState(config, manager, Metrics(lambda: state.snapshots()), guard, events)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if config.engine_processes:  # the engine processes find it (and name it once one has loaded)
            state.device, state.device_name = config.device or "auto", ""
        else:
            state.device, state.device_name = await asyncio.to_thread(_device, config.device)
        manager.start()
        preload = asyncio.create_task(_preload(state))
        try:
            yield
        finally:
            preload.cancel()
            await manager.stop()

    app = FastAPI(title="localserve", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None)  # no pages that load scripts from a CDN
    app.state.localserve = state
    errors.install(app)
    app.include_router(openai_api.router)
    app.include_router(embeddings.router)
    app.include_router(anthropic_api.router)
    app.include_router(admin_api.router)
    app.include_router(ollama_models.router)
    app.include_router(ollama_api.router)
    app.add_middleware(Guard, state=guard)  # type: ignore[arg-type]
    if config.cors_origins:
        # Outermost, so browsers' preflight requests are answered before the key check.
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_origins, allow_methods=["GET", "POST"],  # type: ignore[arg-type]
                           allow_headers=["Authorization", "Content-Type", *ANTHROPIC_HEADERS])
    return app


def _device(wanted: str | None) -> tuple[str, str]:
    """Where models load and its name, found once (torch is imported here, not per request)."""
    from ..engine.engine import pick_device
    from .host import device_name

    device = str(pick_device(wanted))
    return device, device_name(device)


async def _preload(state: ServerState) -> None:
    for name in state.config.preload:
        try:
            await state.manager.load(name)
        except LocalserveError as exc:  # bad input (a file, a name): its one line says it all
            log.error("could not preload %s: %s", name, exc)
        except Exception:
            log.exception("could not preload %s", name)
    if state.config.engine_processes and state.manager.loaded:
        first = next(iter(state.manager.loaded.values())).engine
        state.device, state.device_name = str(first.memory.get("device", state.device)), first.device_name
    state.ready = True
