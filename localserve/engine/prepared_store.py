"""Where a GGUF model's prepared CPU layout (models/prepared.py) is kept, and the engine's
one way to it (``location``, ``load``, ``store``): one file per source file and build, in
the folder ``EngineConfig.prepared_cache`` names (the daemon and the CLI use ``<home>/prepared``).

A file's name holds a digest of its source (the GGUF files' real paths: a registry blob or
any file given by path) and one of everything its contents depend on: each source file's
size and modification time, the CPU kernels' library (its lane count is the layout's), the
model dtype, localserve's version and the format. Anything else is a new name, so a stale
file is never read; it is deleted when its source is next prepared, or when its source is
gone (``prune``).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import mmap
import os
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import models
from ..kernels import cpu_library
from ..models import prepared

if TYPE_CHECKING:
    from ..formats import Checkpoint
    from ..formats.spec import ModelSpec

log = logging.getLogger(__name__)

# Free space kept beyond a new file's size: preparing never fills a disk.
_MARGIN = 1 << 30


def location(folder: str | None, checkpoint: Checkpoint, dtype: torch.dtype) -> Path | None:
    """Where this checkpoint's layout for the int8 kernels is kept: a GGUF file, a cache
    folder configured, the kernels built; else None."""
    if folder is None or checkpoint.gguf is None or not cpu_library.available():
        return None
    build = {"variant": str(cpu_library.variant()), "lanes": str(cpu_library.lanes()), "dtype": str(dtype)}
    try:
        return path_for(Path(folder), checkpoint.gguf.paths, build)
    except OSError as exc:
        log.warning("no prepared layout: %s", exc)
        return None


def load(spec: ModelSpec, stored: Path, device: torch.device, dtype: torch.dtype,
         max_position: int) -> models.LlamaForCausalLM | None:
    """The model mapped from ``stored``, or None: no such file, or one that does not fit
    (deleted, so the caller converts and stores it anew)."""
    if not stored.exists():
        return None
    start = time.monotonic()
    try:
        model = models.build_prepared(spec, stored, device, dtype, max_position)
    except prepared.PreparedMismatch as exc:
        log.warning("the prepared layout %s does not fit (%s): converting the checkpoint again", stored, exc)
        stored.unlink(missing_ok=True)
        return None
    log.info("weights mapped from the prepared layout %s in %.2f s", stored, time.monotonic() - start)
    # Fault the mapping's pages in now, off the caller's thread: else the first request pays
    # for them page by page (a 2.4 GB file: about a second), where llama.cpp's load already has.
    threading.Thread(target=populate, args=(page_ranges(prepared.mapped_tensors(model)),), daemon=True,
                     name="prefault-weights").start()
    return model


_PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = 22  # Linux 5.14: populate the page tables, reading what is not cached
_MADV_WILLNEED = 3  # older kernels: at least start reading ahead


def page_ranges(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The tensors' bytes as page-aligned (start, length) ranges, neighbours (gaps under a
    page: one file's tensors) merged."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel())
    merged: list[list[int]] = []
    for begin, end in spans:
        begin -= begin % _PAGE
        end += -end % _PAGE
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
    return [(begin, end - begin) for begin, end in merged]


def populate(ranges: list[tuple[int, int]]) -> None:
    """Ask the kernel to map these ranges' pages in (the call releases the GIL); a kernel that
    does not know how is asked to read ahead instead, and one that refuses costs nothing."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    advice = _MADV_POPULATE_READ
    for start, length in ranges:
        if madvise(start, length, advice) != 0 and advice == _MADV_POPULATE_READ:
            advice = _MADV_WILLNEED
            madvise(start, length, advice)


def store(model: models.LlamaForCausalLM, stored: Path, checkpoint: Checkpoint) -> None:
    """Keep a freshly built model's layout at ``stored`` when the format takes it and the
    disk has room; then prune the folder. A failure costs a warning, never the load."""
    if not prepared.storable(model) or checkpoint.gguf is None:
        return
    size = sum(linear.nbytes for linear in model.linears()) + sum(experts.nbytes for _, experts in model.experts())
    start = time.monotonic()
    try:
        stored.parent.mkdir(parents=True, exist_ok=True)
        if not has_room(stored.parent, size):
            log.warning("not storing the prepared layout (%.2f GB): too little free space in %s", size / 1e9,
                        stored.parent)
            return
        prepared.save(model, stored, source_label(checkpoint.gguf.paths))
        prune(stored.parent, keep=stored)
    except OSError as exc:
        log.warning("could not store the prepared layout in %s: %s", stored.parent, exc)
        return
    log.info("prepared layout stored as %s (%.2f GB, %.1f s): the next load maps it", stored, size / 1e9,
             time.monotonic() - start)


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
