"""Importing a local checkpoint (a .gguf file or an HF folder) into the registry."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from ..errors import LocalserveError
from ..formats import Checkpoint, open_checkpoint
from ..facts.checkpoint import model_info
from .names import ModelName, parse_name
from .registry import ModelFile, ModelRecord, Registry, check_file_name

# Which files of an HF folder a model needs, by role; anything else (pickled
# weights above all: never loaded) stays behind.
_ROLES = [
    (re.compile(r".*\.safetensors|model\.safetensors\.index\.json"), "weights"),
    (re.compile(r"config\.json|generation_config\.json|quantize_config\.json|quant_config\.json"), "config"),
    (re.compile(r"tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|tokenizer\.model|vocab\.json"
                r"|merges\.txt|added_tokens\.json"), "tokenizer"),
    (re.compile(r"chat_template\.jinja|chat_template\.json"), "template"),
    (re.compile(r"LICEN[CS]E(\.(txt|md))?", re.IGNORECASE), "license"),
]


def role_of(file_name: str) -> str | None:
    for pattern, role in _ROLES:
        if pattern.fullmatch(file_name):
            return role
    return None


def default_name(path: Path) -> ModelName:
    """The file or folder name, lowercased, with what a name may not hold replaced."""
    stem = path.name.removesuffix(".gguf").lower()
    cleaned = re.sub(r"[^a-z0-9._-]+", "-", stem).strip("-._") or "model"
    return parse_name(cleaned[:128])


def record_for(checkpoint: Checkpoint, name: ModelName, source: str, license: str | None = None) -> ModelRecord:
    """The catalogue row for ``checkpoint`` (its metadata read and checked), its files
    still to be added. The license, unless given, is a GGUF's ``general.license``."""
    info, _ = model_info(checkpoint)
    return ModelRecord(
        name=name, format=str(info["format"]),
        architecture=str(info["architecture"]), quantization=str(info["quantization"]),
        parameters=int(info["parameters"]), active_parameters=int(info["active_parameters"]),  # type: ignore[call-overload]
        context_length=int(info["context_length"]), size=0, source=source,  # type: ignore[call-overload]
        license=license or info["license"],  # type: ignore[arg-type]
    )


def register(registry: Registry, record: ModelRecord, files: list[ModelFile]) -> ModelRecord:
    """Register ``record`` with its ``files``, whose blobs are all in the store; if that
    fails, the blobs no model uses are deleted again."""
    record.files = list(files)
    record.size = sum(f.size for f in files)
    try:
        return registry.add(record)
    except BaseException:
        registry.forget_unused(f.digest for f in files)
        raise


def register_fetched(registry: Registry, name: ModelName, files: list[ModelFile], source: str,
                     license: str | None = None) -> ModelRecord:
    """Register downloaded blobs. Their metadata is read first, through a staging folder
    of links, so a model the engine could not open is never listed."""
    ggufs = sorted(f.name for f in files if f.name.lower().endswith(".gguf") and f.role == "weights")
    try:
        with tempfile.TemporaryDirectory(dir=registry.home, prefix="staging-") as staging:
            for file in files:
                os.symlink(registry.blobs.path(file.digest), Path(staging, check_file_name(file.name)))
            entry = Path(staging, ggufs[0]) if ggufs else Path(staging)
            record = record_for(open_checkpoint(entry), name, source, license)
    except BaseException:
        registry.forget_unused(f.digest for f in files)
        raise
    return register(registry, record, files)


def import_local(registry: Registry, path: Path, name: str | None = None) -> ModelRecord:
    """Copy the checkpoint at ``path`` into the store and register it (default name: the
    file or folder name). Its metadata is read before anything is copied, so a broken or
    unsupported checkpoint registers nothing."""
    path = path.expanduser()
    if not path.exists():
        raise LocalserveError(f"{path}: no such file or folder")
    model_name = parse_name(name) if name else default_name(path)
    checkpoint = open_checkpoint(path)
    record = record_for(checkpoint, model_name, f"file:{path.resolve()}")
    if checkpoint.gguf is not None:
        sources = checkpoint.gguf.paths  # with a split GGUF's other parts
    else:
        sources = sorted(p for p in path.iterdir() if p.is_file() and role_of(p.name))
    files = [ModelFile(source.name, registry.blobs.add_file(source), source.stat().st_size,
                       "weights" if path.is_file() else role_of(source.name) or "other") for source in sources]
    return register(registry, record, files)
