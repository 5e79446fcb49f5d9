"""Which models are loaded: loading on demand, keep_alive expiry, LRU unloading.

Models are addressed by name. A request for a model that is not loaded loads it
(concurrent requests share one load); each request's ``keep_alive`` (Ollama's
semantics) sets how long the model stays loaded once idle: 0 unloads right after the
response, a negative value keeps it forever. When the loaded-model limit is reached
or memory runs short, the least recently used idle model is unloaded first.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import math
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..text.chat_template import ChatTemplate
from ..engine.async_engine import AsyncEngine
from ..engine.host_memory import available_host_memory
from ..engine.stats import LoadProgress
from ..errors import InsufficientMemoryError, LocalserveError
from ..text.tokenizer import Tokenizer
from ..registry.settings import ModelSettings
from ..vision.config import read_image_config
from ..vision.placement import ImagePlacement
from .catalog import CatalogEntry, ModelCatalog
from .config import DEFAULT_KEEP_ALIVE_S
from .events import EventLog

log = logging.getLogger(__name__)

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_EXPIRY_CHECK_S = 0.25
_REGISTRY_CHECK_S = 1.0  # how soon a pull or removal by the CLI is noticed (logged; a removed model unloaded)
# Characters a prompt may hold per token of the context: far more than any tokenizer packs
# into a token on average, so a longer prompt could never fit, and is refused untokenized.
MAX_CHARS_PER_TOKEN = 64
# The longest finite keep-alive: ten years. Longer is a mistake (-1 keeps a model forever),
# and a time that far out cannot be shown as a date.
MAX_KEEP_ALIVE_S = 10 * 365 * 24 * 3600


# Builds a model's engine (on a worker thread), reporting how far it got.
Loader = Callable[[CatalogEntry, LoadProgress], AsyncEngine]


class ModelUnavailableError(LocalserveError):
    """The model cannot serve now (loading, or no room to load it); retry after ``retry_after`` s."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def parse_keep_alive(value: str | float | None) -> float | None:
    """Seconds an idle model stays loaded; ``math.inf`` for forever, None for "the default".

    Accepts Ollama's forms: a number of seconds (``300``, ``0``, ``-1``) or a Go
    duration (``"5m"``, ``"1h30m"``, ``"90s"``, ``"-1m"``); negative means forever, and a
    finite time may be at most ``MAX_KEEP_ALIVE_S``.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError("keep_alive must be a duration, not a boolean")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)
        except ValueError:
            parts = _DURATION_PART.findall(body)
            if not body or "".join(number + unit for number, unit in parts) != body:
                raise ValueError(f"keep_alive {value!r} is not a duration (e.g. 300, \"5m\", \"1h30m\", 0, -1)")
            seconds = sign * sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
    if math.isnan(seconds):
        raise ValueError("keep_alive must be a number of seconds or a duration")
    if seconds > MAX_KEEP_ALIVE_S:
        raise ValueError(f"keep_alive {value!r} is longer than {MAX_KEEP_ALIVE_S} s (ten years); "
                         "-1 keeps the model loaded forever")
    return math.inf if seconds < 0 else seconds


@dataclass(eq=False)
class LoadedModel:
    name: str
    path: Path
    engine: AsyncEngine
    version: str = ""  # the catalogue's version of the name when loaded (a new pull changes it)
    loaded_at: float = field(default_factory=time.time)  # wall clock, for display
    last_used: float = field(default_factory=time.monotonic)
    keep_alive: float = DEFAULT_KEEP_ALIVE_S
    expires_at: float | None = None  # monotonic; None while in use or kept forever
    active: int = 0  # requests being served
    settings: ModelSettings = ModelSettings()  # its own defaults, under each request's fields

    _chat_template: ChatTemplate | None = field(default=None, init=False, repr=False)
    _description: dict[str, str] | None = field(default=None, init=False, repr=False)

    @property
    def idle(self) -> bool:
        return self.active == 0

    # What the HTTP layer needs of the model, none of it torch.
    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.engine.spec.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.engine.engine.spec.hidden_size

    @property
    def embeds(self) -> bool:
        """An embedding model: it answers the embeddings endpoints, not the generating ones."""
        return self.engine.engine.spec.pooling is not None

    @property
    def max_num_seqs(self) -> int:
        return self.engine.engine.config.max_num_seqs

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.engine.tokenizer

    def tokenizer_or_error(self) -> Tokenizer:
        if self.tokenizer is None:
            raise LocalserveError(f"model {self.name!r} has no tokenizer; send token ids")
        return self.tokenizer

    def check_prompt_chars(self, chars: int) -> None:
        """Refuse, before any tokenizing, a prompt too long to fit in any case."""
        limit = self.max_model_len * MAX_CHARS_PER_TOKEN
        if chars > limit:
            raise LocalserveError(
                f"the prompt has {chars:,} characters, more than {self.name}'s {self.max_model_len:,}-token context "
                f"could hold ({limit:,}: {MAX_CHARS_PER_TOKEN} per token); shorten it")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_prompt_chars(len(text))
        return self.tokenizer_or_error().encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer_or_error().decode(ids)

    @functools.cached_property
    def images(self) -> ImagePlacement | None:
        """Where images go in its prompts; None for a model that reads no images."""
        image_config = read_image_config(self.engine.engine.checkpoint)
        return ImagePlacement(image_config.layout(), image_config.tokens_for, self.tokenizer) if image_config else None

    def chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            self._chat_template = self.engine.engine.checkpoint.chat_template(self.settings.template)
        return self._chat_template

    def description(self) -> dict[str, str]:
        """Its format and quantization (``localserve show``'s words), worked out once."""
        if self._description is None:
            from ..facts.checkpoint import checkpoint_format, quantization

            checkpoint = self.engine.engine.checkpoint
            self._description = {"format": checkpoint_format(checkpoint), "quantization": quantization(checkpoint)}
        return self._description

    def load_wait(self, since: float) -> float:
        """Seconds a request that arrived at ``since`` (wall clock) waited for this model
        to load: until now if it was loaded meanwhile, else 0 (Ollama's load_duration)."""
        return time.time() - since if self.loaded_at >= since else 0.0

    def expires_wall(self) -> float | None:
        """The expiry on the wall clock (None: in use or kept forever)."""
        if self.expires_at is None:
            return None
        return time.time() + (self.expires_at - time.monotonic())


@dataclass
class ManagerOptions:
    default_keep_alive: float = DEFAULT_KEEP_ALIVE_S  # seconds; math.inf keeps forever
    max_loaded_models: int = 3
    # Bytes a load would take beyond what is there (None: do not check); see needed_bytes.
    needed_bytes: Callable[[Path], int | None] = lambda path: None
    available_bytes: Callable[[], int | None] = lambda: available_host_memory().available


class ModelManager:
    """Owns the loaded models; all methods run on the server's event loop."""

    def __init__(self, catalog: ModelCatalog, open_engine: Loader,
                 options: ManagerOptions | None = None, events: EventLog | None = None) -> None:
        self.catalog = catalog
        self.events = events or EventLog()
        self.options = options or ManagerOptions()
        self._open_engine = open_engine
        self.loaded: dict[str, LoadedModel] = {}
        self._loading: dict[str, asyncio.Task[LoadedModel]] = {}
        self.load_progress: dict[str, LoadProgress] = {}  # the loads under way
        self.waiting: dict[str, int] = {}  # requests waiting for a load under way, per model
        self._background: list[asyncio.Task[None]] = []

    def names(self) -> list[str]:
        return self.catalog.names()

    def is_loading(self, name: str) -> bool:
        return name in self._loading

    def loaded_name(self, name: str) -> str:
        """The loaded model ``name`` refers to (``stories`` -> ``stories:latest``), even if
        it has since been removed from the registry; ModelNotFoundError if none is."""
        canonical = self.catalog.canonical(name)
        if canonical in self.loaded:
            return canonical  # type: ignore[return-value]
        return self.catalog.find(name).name  # raises for an unknown name

    # -- serving ------------------------------------------------------------------------

    async def acquire(self, name: str, wait: float | None = None) -> LoadedModel:
        """The loaded model ``name``, loading it if needed, marked in use until ``release``.

        ``wait``: seconds the caller will wait for a load (None: as long as it takes);
        past it, ModelUnavailableError with a Retry-After hint.
        """
        model = await self.load(name, wait)
        model.active += 1
        model.expires_at = None
        model.last_used = time.monotonic()
        return model

    def release(self, model: LoadedModel, keep_alive: float | None = None) -> None:
        """End one request's use; ``keep_alive`` (seconds, inf, or None for the
        model's current setting) starts counting once the model is idle."""
        model.active -= 1
        model.last_used = time.monotonic()
        if keep_alive is not None:
            model.keep_alive = keep_alive
        if model.idle:
            self._schedule_expiry(model)

    def _schedule_expiry(self, model: LoadedModel) -> None:
        if model.keep_alive == 0:
            model.expires_at = time.monotonic()  # the expiry check unloads it unless a request comes first
            asyncio.get_running_loop().create_task(self._unload_if_expired(model))
        elif math.isinf(model.keep_alive):
            model.expires_at = None
        else:
            model.expires_at = time.monotonic() + model.keep_alive

    # -- loading and unloading -------------------------------------------------------------

    async def load(self, name: str, wait: float | None = None, keep_alive: float | None = None) -> LoadedModel:
        """Load ``name`` (or join a load under way); ``keep_alive`` applies from now.
        A model whose name was pulled anew since it was loaded is reloaded once idle."""
        entry = self.catalog.find(name)
        name = entry.name
        model = self.loaded.get(name)
        if model is not None and model.version != entry.version and model.idle:
            await self.unload(name, "its name was pulled anew; reloading")
            model = None
        if model is not None and model.engine.dead:  # its engine process ended (killed, crashed)
            await self.unload(name, "its engine process ended; loading it again")
            model = None
        if model is None:
            task = self._loading.get(name)
            if task is None:
                task = asyncio.get_running_loop().create_task(self._load(entry))
                self._loading[name] = task
                task.add_done_callback(lambda _: self._loading.pop(name, None))
            self.waiting[name] = self.waiting.get(name, 0) + 1
            try:
                model = await asyncio.wait_for(asyncio.shield(task), wait)
            except TimeoutError:
                raise ModelUnavailableError(f"model {name!r} is loading; retry shortly", retry_after=2) from None
            finally:
                self.waiting[name] -= 1
                if not self.waiting[name]:
                    del self.waiting[name]
        if keep_alive is not None:
            model.keep_alive = keep_alive
            if model.idle:
                self._schedule_expiry(model)
        return model

    async def _load(self, entry: CatalogEntry) -> LoadedModel:
        progress = self.load_progress[entry.name] = LoadProgress()
        try:
            return await self._load_reporting(entry, progress)
        finally:
            del self.load_progress[entry.name]

    async def _load_reporting(self, entry: CatalogEntry, progress: LoadProgress) -> LoadedModel:
        name, path = entry.name, entry.path
        started = time.monotonic()
        progress.step("making room")
        while len(self.loaded) >= self.options.max_loaded_models:
            await self._unload_lru_idle(f"{len(self.loaded)} models are loaded, the most allowed")
        await self._make_room(path)
        while True:
            try:
                engine = await asyncio.to_thread(self._open_engine, entry, progress)
                break
            except InsufficientMemoryError as exc:
                await self._unload_lru_idle(str(exc))
            except Exception as exc:
                self.events.add("load_failed", name, str(exc).splitlines()[0][:300] if str(exc) else repr(exc))
                raise
        model = LoadedModel(name, path, engine, entry.version, keep_alive=self.options.default_keep_alive,
                            settings=entry.settings)
        # What a load leaves (torch, the model, its tokenizer: millions of objects) lives as
        # long as the model: out of the collector's reach, so that a full collection does
        # not walk it all and stall the event loop for a tenth of a second mid-request.
        gc.freeze()
        self._schedule_expiry(model)
        self.loaded[name] = model
        self.catalog.touch(name)
        self.events.add("load", name, f"loaded from {path} in {time.monotonic() - started:.1f} s")
        return model

    async def _make_room(self, path: Path) -> None:
        """Unload idle models (least recently used first) while the estimate of what
        loading ``path`` takes exceeds the memory available. With none loaded there is
        nothing to unload: the estimate (which imports torch) is not made."""
        if not self.loaded:
            return
        needed = self.options.needed_bytes(path)
        if needed is None:
            return
        while (available := self.options.available_bytes()) is not None and needed > available:
            if not any(model.idle for model in self.loaded.values()):
                log.warning("loading %s needs ~%d MiB, %d MiB are available; trying anyway", path,
                            needed >> 20, available >> 20)
                return
            await self._unload_lru_idle("memory is short")

    async def _unload_lru_idle(self, reason: str) -> None:
        idle = [model for model in self.loaded.values() if model.idle]
        if not idle:
            raise ModelUnavailableError(f"{reason}, and every loaded model is serving requests; retry shortly",
                                        retry_after=5)
        victim = min(idle, key=lambda model: model.last_used)
        await self.unload(victim.name, f"least recently used, to make room: {reason}")

    async def unload(self, name: str, reason: str = "requested") -> bool:
        """Unload ``name`` now; requests still running on it end with an error."""
        model = self.loaded.pop(name, None)
        if model is None:
            return False
        await asyncio.to_thread(model.engine.shutdown)
        del model
        await asyncio.to_thread(_release_memory)
        self.events.add("unload", name, f"unloaded ({reason})")
        return True

    async def replace_sources(self, sources: dict[str, Path]) -> list[str]:
        """Serve ``sources`` as the named models from now on (the model list reloaded
        on SIGHUP). A loaded model whose name is gone unloads now if idle, else after
        its last request; one whose path changed is reloaded at its next load, like a
        name pulled anew. Returns the names that are new or point elsewhere."""
        old = self.catalog.replace_sources(sources)
        changed = [name for name, path in sources.items() if old.get(name) != path]
        removed = [name for name in old if name not in sources]
        for name in removed:
            model = self.loaded.get(name)
            if model is not None and model.idle:
                await self.unload(name, "no longer in the model list")
            elif model is not None:
                model.keep_alive = 0  # release() unloads it once idle
        self.events.add("reload", None, f"model list reloaded: {len(sources)} named models"
                        f"{'; new or changed: ' + ', '.join(changed) if changed else ''}"
                        f"{'; removed: ' + ', '.join(removed) if removed else ''}")
        return changed

    async def unload_all(self) -> None:
        for name in list(self.loaded):
            await self.unload(name, "shutting down")

    # -- expiry ---------------------------------------------------------------------------

    def start(self) -> None:
        for name in self.catalog.hidden():
            message = (f"the registry's {name} is not served: --model {self.catalog.canonical(name)} has its name "
                       "(rename one of them to serve both)")
            log.warning("%s", message)
            self.events.add("hidden", name, message)
        loop = asyncio.get_running_loop()
        self._background = [loop.create_task(self._expire_forever()), loop.create_task(self._watch_registry_forever())]

    async def stop(self) -> None:
        for task in self._background:
            task.cancel()
        for task in list(self._loading.values()):
            task.cancel()
        await self.unload_all()
        gc.unfreeze()  # what is left is the collector's again (and is finalized at exit)

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(_EXPIRY_CHECK_S)
            for model in list(self.loaded.values()):
                await self._unload_if_expired(model)

    async def _watch_registry_forever(self) -> None:
        while True:
            try:
                await self.check_registry()
            except Exception:  # a registry mid-rewrite, say: next time
                log.debug("registry check failed", exc_info=True)
            await asyncio.sleep(_REGISTRY_CHECK_S)

    async def check_registry(self) -> None:
        """Log the models pulled or removed since the last look (the CLI changes the
        registry; the daemon only sees the result), and unload a removed model that is
        loaded: at once if idle, else after its last request."""
        registered = self.catalog.registered()
        self.events.note_registry(registered)
        for name, model in list(self.loaded.items()):
            if name in registered or name in self.catalog.sources:
                continue
            if model.idle:
                await self.unload(name, "removed from the registry")
            else:
                model.keep_alive = 0  # release() unloads it once idle

    async def _unload_if_expired(self, model: LoadedModel) -> None:
        expired = model.idle and model.expires_at is not None and model.expires_at <= time.monotonic()
        if expired and self.loaded.get(model.name) is model:
            await self.unload(model.name, "keep_alive expired")


def _release_memory() -> None:
    """Return an unloaded model's memory: collect cycles (the frozen objects included:
    the model's are among them), then empty torch's CUDA cache."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    torch = sys.modules.get("torch")  # not imported where engines run in processes of their own
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
