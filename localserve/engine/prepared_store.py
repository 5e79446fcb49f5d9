"""Where a GGUF model's prepared CPU layout (models/prepared.py) is kept: one file per
source file and build, in the folder ``EngineConfig.prepared_cache`` names (the daemon and
the CLI use ``<home>/prepared``).

A file's name holds a digest of its source (the GGUF files' real paths: a registry blob or
any file given by path) and one of everything its contents depend on: each source file's
size and modification time, the CPU kernels' library (its lane count is the layout's), the
model dtype, localserve's version and the format. Anything else is a new name, so a stale
file is never read; it is deleted when its source is next prepared, or when its source is
gone (``prune``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

# Free space kept beyond a new file's size: preparing never fills a disk.
_MARGIN = 1 << 30


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def path_for(folder: Path, sources: list[Path], build: dict[str, str]) -> Path:
    """The prepared file for these source files under this build (``build``: the kernels'
    variant, dtype and the like)."""
    real = [str(Path(p).resolve()) for p in sources]
    stamps = []
    for path in real:
        stat = os.stat(path)
        stamps.append([path, stat.st_size, stat.st_mtime_ns])
    key = json.dumps({"files": stamps, "build": build, "code": _code_digest()}, sort_keys=True)
    return folder / f"{_digest(json.dumps(real))}-{_digest(key)}.safetensors"


def _code_digest() -> str:
    """What the layout is made by: the converting and storing code itself, so that a
    change to it (a new localserve, an edited checkout) never reads an older layout."""
    from localserve.formats import gguf_iquants, gguf_quants, weights
    from localserve.kernels import quant_linear_cpu, quant_weight
    from localserve.models import layers, prepared

    digest = hashlib.sha256()
    for module in (gguf_quants, gguf_iquants, weights, quant_weight, quant_linear_cpu, layers, prepared):
        digest.update(Path(module.__file__).read_bytes())  # type: ignore[arg-type]
    return digest.hexdigest()


def source_label(sources: list[Path]) -> str:
    return json.dumps([str(Path(p).resolve()) for p in sources])


def has_room(folder: Path, size: int) -> bool:
    try:
        return shutil.disk_usage(folder).free >= size + _MARGIN
    except OSError:
        return False


def prune(folder: Path, keep: Path | None = None) -> None:
    """Delete prepared files of the same source as ``keep`` (older builds), files whose
    sources no longer exist (a removed model), and partial files of an interrupted write."""
    if not folder.is_dir():
        return
    same_source = keep.name.split("-")[0] if keep is not None else None
    for path in folder.iterdir():
        if path == keep or not path.name.endswith((".safetensors", ".partial")):
            continue
        stale = path.name.endswith(".partial") or path.name.split("-")[0] == same_source or not _source_exists(path)
        if stale:
            try:
                path.unlink()
                log.info("removed the stale prepared layout %s", path.name)
            except OSError:
                pass


def _source_exists(path: Path) -> bool:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            sources = json.loads((handle.metadata() or {}).get("source", "[]"))
    except (SafetensorError, OSError, ValueError):
        return False
    return isinstance(sources, list) and bool(sources) and all(isinstance(s, str) and Path(s).exists() for s in sources)
