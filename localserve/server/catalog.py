"""The names the daemon serves: the ``--model`` ones, then the registry's, as one namespace.

The registry is read at each lookup (a small sqlite query), so a model pulled or
removed by the CLI is served, or refused, from the next request on, with no restart.

A ``--model`` name wins: ``stories`` given with ``--model`` is what ``stories`` and
``stories:latest`` mean to every route and command, and a registry model of that name
is hidden (the daemon warns at start), so no two models answer to one name.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from ..errors import LocalserveError
from ..registry import Registry, parse_name
from ..registry.settings import ModelSettings


class ModelNotFoundError(LocalserveError):
    """No model of that name is known."""


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    name: str  # canonical: as given with --model, else the registry's name:tag
    path: Path  # what the engine opens
    version: str  # changes when the name comes to mean other files (a new pull)
    created: float  # seconds since the epoch, for /v1/models
    settings: ModelSettings = ModelSettings()  # the model's own defaults (a Modelfile's)


class ModelCatalog:
    def __init__(self, sources: dict[str, Path] | None = None, registry_home: Path | None = None) -> None:
        self.sources = dict(sources or {})
        self._registry_home = registry_home
        self._registry: Registry | None = None

    @property
    def registry(self) -> Registry | None:
        if self._registry is None and self._registry_home is not None:
            self._registry = Registry(self._registry_home)
        return self._registry

    def replace_sources(self, sources: dict[str, Path]) -> dict[str, Path]:
        """Serve ``sources`` from now on and reopen the registry at the next lookup (its
        file may have been replaced); returns the sources before."""
        old, self.sources = self.sources, dict(sources)
        self._registry = None  # a worker thread may still hold the old one: let it close when dropped
        return old

    def find(self, name: str) -> CatalogEntry:
        source = self._source_named(name)
        if source is not None:
            path = self.sources[source]
            return CatalogEntry(source, path, str(path), path.stat().st_mtime if path.exists() else 0.0)
        entry = self._registered(name)
        if entry is None:
            known = ", ".join(self.names()[:20]) or "none"
            raise ModelNotFoundError(f"model {name!r} does not exist (known models: {known}; "
                                     "`localserve pull` adds one)")
        return entry

    def canonical(self, name: str) -> str | None:
        """The name ``name`` is known by: a ``--model`` name (``stories`` and
        ``stories:latest`` alike, when ``stories`` was given), else the registry's form
        (``stories`` -> ``stories:latest``); None when it cannot be a name."""
        return self._source_named(name) or _registry_form(name)

    def _source_named(self, name: str) -> str | None:
        """The ``--model`` name that ``name`` means, if any."""
        if name in self.sources:
            return name
        form = _registry_form(name)
        return next((source for source in self.sources if form is not None and _registry_form(source) == form), None)

    def hidden(self) -> list[str]:
        """Registry models that a ``--model`` name hides."""
        if self.registry is None:
            return []
        return [str(r.name) for r in self.registry.list() if self._source_named(str(r.name)) is not None]

    def _registered(self, name: str) -> CatalogEntry | None:
        canonical = self.canonical(name)
        if self.registry is None or canonical is None:
            return None
        try:
            record = self.registry.get(canonical)
            path = self.registry.path(record.name)
        except LocalserveError:
            return None
        version = ",".join(sorted(f.digest for f in record.files))
        created = _epoch(record.created)
        return CatalogEntry(canonical, path, version, created, self.registry.settings(record))

    def names(self) -> list[str]:
        return sorted(self.sources) + self.registered()

    def registered(self) -> list[str]:
        """The registry's models this daemon serves (those no ``--model`` name hides)."""
        registered = [str(r.name) for r in self.registry.list()] if self.registry is not None else []
        return [name for name in registered if self._source_named(name) is None]

    def touch(self, name: str) -> None:
        """Note in the registry that ``name`` was loaded (its ``last_used``)."""
        if self.registry is not None and self._source_named(name) is None:
            try:
                self.registry.touch(parse_name(name))
            except LocalserveError:
                pass


def _registry_form(name: str) -> str | None:
    try:
        return str(parse_name(name))
    except LocalserveError:
        return None


def _epoch(iso: str) -> float:
    try:
        return dt.datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return 0.0
