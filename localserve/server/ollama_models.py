"""Ollama's model routes, shaped as Ollama documents them: ``/api/tags``, ``/api/show``,
``/api/ps``, ``/api/pull`` (streamed progress), ``/api/create``, ``/api/delete``, ``/api/copy``,
``/api/version`` and ``/``. Where localserve's own tools read one of these routes
(``/api/ps``, ``/api/version``) the answer is Ollama's with localserve's fields beside them.

Ollama's names are ``model:tag``; so are the registry's. A model named with ``--model``
is listed and shown too, but cannot be deleted or copied (it is a path, not a registry
entry).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import platform
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from .. import __version__
from ..errors import LocalserveError
from ..registry.modelfile import modelfile_of
from .catalog import CatalogEntry
from .model_manager import LoadedModel
from .ollama_protocol import CopyRequest, CreateRequest, ModelRequest, PullRequest
from .state import state_of

router = APIRouter()

# The Ollama release whose API these routes follow: clients read /api/version to decide
# what they may use (tools, structured outputs, thinking), and localserve's own version
# number would tell them an older Ollama than the API they get.
OLLAMA_API_VERSION = "0.12.6"


def iso(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return dt.datetime.fromtimestamp(timestamp, dt.timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What Ollama's model routes say of a model, read from its metadata."""

    format: str
    architecture: str
    parameters: int
    quantization: str
    context_length: int
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    file_bytes: int
    template: str | None
    license: str | None
    pooling: str | None  # an embedding model's
    vision: bool  # it reads images


@lru_cache(maxsize=64)
def _facts(path: Path, version: str) -> ModelFacts:
    """Metadata only (no weights read); ``version`` changes when the name means new files."""
    from ..facts.checkpoint import model_info
    from ..formats import open_checkpoint

    checkpoint = open_checkpoint(path)
    info, _ = model_info(checkpoint)
    try:
        template = checkpoint.chat_template_or_none()
    except LocalserveError:  # a broken one: listed without it; a chat request says what is wrong
        template = None
    return ModelFacts(
        format=str(info["format"]), architecture=str(info["architecture"]), parameters=int(info["parameters"]),
        quantization=str(info["quantization"]), context_length=int(info["context_length"]),
        layers=int(info["layers"]), hidden_size=int(info["hidden_size"]), heads=int(info["heads"]),
        kv_heads=int(info["kv_heads"]), file_bytes=int(info["file_bytes"]),
        template=template.source if template is not None else None, license=info["license"],  # type: ignore[arg-type]
        pooling=checkpoint.spec.pooling, vision=checkpoint.reads_images)


def _digest(entry: CatalogEntry) -> str:
    """A 64-hex digest that changes when the name comes to mean other files."""
    return hashlib.sha256(entry.version.encode()).hexdigest()


def _parameter_size(count: int) -> str:
    """Ollama's way: ``494.03M``, ``7.6B``."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= size:
            return f"{count / size:.2f}".rstrip("0").rstrip(".") + unit
    return str(count)


def _details(facts: ModelFacts) -> dict[str, Any]:
    return {"parent_model": "", "format": facts.format, "family": facts.architecture,
            "families": [facts.architecture], "parameter_size": _parameter_size(facts.parameters),
            # the tensor type that holds most of the file (GGUF), else GPTQ/AWQ's or the dtype
            "quantization_level": facts.quantization.split(",")[0].split(" ")[0]}


def _capabilities(facts: ModelFacts) -> list[str]:
    from ..chat import reasoning

    if facts.pooling:
        return ["embedding"]
    found = ["completion"]
    if facts.template and "tools" in facts.template:
        found.append("tools")
    if facts.template and reasoning.thinks(facts.template):
        found.append("thinking")
    if facts.vision:
        found.append("vision")
    return found


async def _entry_and_facts(request: Request, name: str) -> tuple[CatalogEntry, ModelFacts]:
    entry = state_of(request).manager.catalog.find(name)  # ModelNotFoundError: a 404
    return entry, await asyncio.to_thread(_facts, entry.path, entry.version)


@router.get("/")
@router.head("/")
async def root() -> PlainTextResponse:
    """Ollama's clients check that the server is up here."""
    return PlainTextResponse("localserve is running (it speaks Ollama's API and OpenAI's)")


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_API_VERSION, "localserve": __version__, "python": platform.python_version()}


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    catalog = state_of(request).manager.catalog
    models = []
    for name in catalog.names():
        try:
            entry, facts = await _entry_and_facts(request, name)
        except LocalserveError:
            continue  # a file that went away or cannot be read is not listed
        models.append({"name": entry.name, "model": entry.name, "modified_at": iso(entry.created),
                       "size": facts.file_bytes, "digest": _digest(entry), "details": _details(facts)})
    return {"models": models}


@router.post("/api/show")
async def show(request: Request, body: ModelRequest) -> dict[str, Any]:
    entry, facts = await _entry_and_facts(request, body.model)
    settings = entry.settings
    if settings.template is not None:  # the model's own TEMPLATE, in place of the checkpoint's
        facts = replace(facts, template=settings.template)
    arch = facts.architecture
    shown = {
        "modelfile": modelfile_of(entry.name, str(entry.path), settings),
        "parameters": "\n".join(settings.parameter_lines()),
        "template": facts.template or "",
        "license": facts.license or "",
        "details": _details(facts),
        # GGUF's key names, which Ollama's clients read (the context length above all).
        "model_info": {"general.architecture": arch, "general.parameter_count": facts.parameters,
                       f"{arch}.context_length": facts.context_length, f"{arch}.block_count": facts.layers,
                       f"{arch}.embedding_length": facts.hidden_size, f"{arch}.attention.head_count": facts.heads,
                       f"{arch}.attention.head_count_kv": facts.kv_heads},
        "capabilities": _capabilities(facts),
        "modified_at": iso(entry.created),
        "settings": settings.as_dict(),  # localserve's: the same defaults as JSON (`localserve run` reads them)
    }
    if settings.system is not None:
        shown["system"] = settings.system
    if settings.messages:
        shown["messages"] = [dict(m) for m in settings.messages]
    return shown


@router.post("/api/create")
async def create(request: Request, body: CreateRequest) -> Response:
    """A model made from another with its own defaults: Ollama's fields (``from``,
    ``parameters``, ``system``, ``template``, ``messages``, ``license``) or, from older
    clients, a whole ``modelfile``; FROM is a registry name, or a file or folder on the
    server's machine below a folder the operator allowed. The answer is Ollama's progress objects, streamed unless
    ``stream`` is false."""
    modelfile = body.modelfile_or_fields()
    steps = ["parsing modelfile", "reading model metadata", "writing manifest"]

    def run() -> None:
        from ..registry.create import create_model

        local_roots = state_of(request).config.allow_pull_from
        create_model(_registry(request), body.model, modelfile, local_roots=local_roots)

    if not body.stream:
        await asyncio.to_thread(run)
        return JSONResponse({"status": "success"})

    async def events() -> AsyncIterator[dict[str, Any]]:
        for step in steps[:2]:
            yield {"status": step}
        try:
            await asyncio.to_thread(run)
        except LocalserveError as exc:
            yield {"error": str(exc)}
            return
        yield {"status": steps[2]}
        yield {"status": "success"}

    return ndjson(events())


def _loaded_model(model: LoadedModel, entry: CatalogEntry | None, facts: ModelFacts | None) -> dict[str, Any]:
    memory = model.engine.memory
    held = sum(int(memory.get(key, 0)) for key in ("weights_bytes", "host_weights_bytes", "kv_cache_bytes",
                                                   "cpu_kv_cache_bytes"))
    on_device = 0 if str(memory.get("device", "cpu")) == "cpu" else \
        int(memory.get("weights_bytes", 0)) + int(memory.get("kv_cache_bytes", 0))
    expires = model.expires_wall()
    return {
        # Ollama's fields
        "name": model.name, "model": model.name, "size": held, "size_vram": on_device,
        "digest": _digest(entry) if entry else "", "details": _details(facts) if facts else {},
        "context_length": model.max_model_len,
        "expires_at": iso(expires),  # null: in use, or kept loaded forever
        # localserve's
        "path": str(model.path), "loaded_at": iso(model.loaded_at),
        "keep_alive_s": None if model.keep_alive == float("inf") else model.keep_alive,
        "requests_in_flight": _in_flight(model), "max_model_len": model.max_model_len, "memory": memory,
    }


def _in_flight(model: LoadedModel) -> int:
    """The engine's requests, from the same snapshot as its scheduler counts (so the
    dashboard's figures agree with each other)."""
    stats = model.engine.stats
    return stats.num_running + stats.num_waiting + stats.num_swapped if stats is not None else 0


async def loaded_model(request: Request, model: LoadedModel) -> dict[str, Any]:
    """A loaded model as /api/ps lists it (the dashboard's stats start from it)."""
    try:
        entry, facts = await _entry_and_facts(request, model.name)
    except LocalserveError:
        return _loaded_model(model, None, None)  # renamed or removed since it loaded
    return _loaded_model(model, entry, facts)


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    """Loaded models (and, localserve's, those loading)."""
    manager = state_of(request).manager
    return {"models": [await loaded_model(request, model) for model in list(manager.loaded.values())],
            "loading": [name for name in manager.names() if manager.is_loading(name)]}


def _registry(request: Request):  # type: ignore[no-untyped-def]
    """A registry of its own for a worker thread (sqlite connections stay on their thread)."""
    from ..registry import Registry

    home = state_of(request).config.registry_home
    if home is None:
        raise LocalserveError("this server has no model registry (it serves --model paths only)")
    return Registry(home)


def _registered(request: Request, name: str) -> str:
    """The registry name ``name`` means; errors for a --model source or an unknown name."""
    entry = state_of(request).manager.catalog.find(name)
    if entry.name in state_of(request).manager.catalog.sources:
        raise LocalserveError(f"{name!r} is a --model path given to the server, not a registry model")
    return entry.name


@router.delete("/api/delete")
async def delete(request: Request, body: ModelRequest) -> Response:
    name = _registered(request, body.model)
    manager = state_of(request).manager
    if name in manager.loaded:
        await manager.unload(name)
    await asyncio.to_thread(lambda: _registry(request).remove(name))
    return Response(status_code=200)


@router.post("/api/copy")
async def copy(request: Request, body: CopyRequest) -> Response:
    source = _registered(request, body.source)
    await asyncio.to_thread(lambda: _registry(request).copy(source, body.destination))
    return Response(status_code=200)


class _PullProgress:
    """What the registry's downloads report (rich's Progress calls), as Ollama's progress
    objects on a queue the response reads; called from the pulling thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[dict[str, Any] | None]) -> None:
        self.loop, self.queue = loop, queue
        self.tasks: dict[int, list[Any]] = {}  # task -> [file name, total, completed]

    def put(self, event: dict[str, Any] | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def start(self) -> None:
        pass

    def add_task(self, name: str, total: int | None = None, **_: Any) -> int:
        self.tasks[len(self.tasks)] = [name, total, 0]
        self._report(len(self.tasks) - 1)
        return len(self.tasks) - 1

    def update(self, task: int, completed: int | None = None, **_: Any) -> None:
        if completed is not None:
            self.tasks[task][2] = completed
            self._report(task)

    def advance(self, task: int, amount: float) -> None:
        self.tasks[task][2] += int(amount)
        self._report(task)

    def _report(self, task: int) -> None:
        name, total, completed = self.tasks[task]
        self.put({"status": f"pulling {name}", "digest": name, "total": total or 0, "completed": completed})


@router.post("/api/pull")
async def pull(request: Request, body: PullRequest) -> Response:
    """Pull a source as ``localserve pull`` takes it: hf.co/<owner>/<repo>[:<tag>], an
    https URL of a .gguf, or a file or folder on the server's machine, only below a folder
    the operator allowed (``serve --allow-pull-from``)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    progress = _PullProgress(loop, queue)

    def run() -> str:
        from ..registry.pull import pull as pull_source

        local_roots = state_of(request).config.allow_pull_from
        return str(pull_source(_registry(request), body.model, progress=progress,  # type: ignore[arg-type]
                               local_roots=local_roots).name)

    if not body.stream:
        await asyncio.to_thread(run)
        return JSONResponse({"status": "success"})

    async def events() -> AsyncIterator[dict[str, Any]]:
        yield {"status": "pulling manifest"}
        job = asyncio.ensure_future(asyncio.to_thread(run))
        job.add_done_callback(lambda _: progress.put(None))
        while (event := await queue.get()) is not None:
            yield event
        try:
            job.result()
        except LocalserveError as exc:
            yield {"error": str(exc)}
            return
        yield {"status": "verifying sha256 digest"}
        yield {"status": "writing manifest"}
        yield {"status": "success"}

    return ndjson(events())


def ndjson(items: AsyncIterator[dict[str, Any]], on_close: Callable[[], None] | None = None) -> StreamingResponse:
    """Ollama's streams: one JSON object a line."""

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for item in items:
                yield json.dumps(item, ensure_ascii=False).encode() + b"\n"
        finally:
            if on_close is not None:
                on_close()

    return StreamingResponse(lines(), media_type="application/x-ndjson")

