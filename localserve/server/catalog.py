"""The names the daemon serves: the ``--model`` ones, then the registry's.

The registry is read at each lookup (a small sqlite query), so a model pulled or
removed by the CLI is served, or refused, from the next request on, with no restart.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from ..errors import LocalserveError
from ..registry import Registry, parse_name


class ModelNotFoundError(LocalserveError):
    """No model of that name is known."""


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    name: str  # canonical: as given with --model, else the registry's name:tag
    path: Path  # what the engine opens
    version: str  # changes when the name comes to mean other files (a new pull)
    created: float  # seconds since the epoch, for /v1/models


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
        if name in self.sources:
            path = self.sources[name]
            return CatalogEntry(name, path, str(path), path.stat().st_mtime if path.exists() else 0.0)
        entry = self._registered(name)
        if entry is None:
            known = ", ".join(self.names()[:20]) or "none"
            raise ModelNotFoundError(f"model {name!r} does not exist (known models: {known}; "
                                     "`localserve pull` adds one)")
        return entry

    def canonical(self, name: str) -> str | None:
        """``stories`` -> ``stories:latest`` for a registry name; None when unknown."""
        if name in self.sources:
            return name
        try:
            return str(parse_name(name))
        except LocalserveError:
            return None

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
        return CatalogEntry(canonical, path, version, created)

    def names(self) -> list[str]:
        registered = [str(r.name) for r in self.registry.list()] if self.registry is not None else []
        return sorted(self.sources) + [name for name in registered if name not in self.sources]

    def touch(self, name: str) -> None:
        """Note in the registry that ``name`` was loaded (its ``last_used``)."""
        if self.registry is not None and name not in self.sources:
            try:
                self.registry.touch(parse_name(name))
            except LocalserveError:
                pass


def _epoch(iso: str) -> float:
    try:
        return dt.datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return 0.0
