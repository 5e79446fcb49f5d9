"""Importing a local checkpoint (a .gguf file or an HF folder) into the registry."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from ..errors import LocalserveError
from ..formats.gguf_file import read_gguf, split_paths
from ..model_info import model_info
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


def record_for(path: Path, name: ModelName, source: str, license: str | None = None) -> ModelRecord:
    """The catalogue row for the checkpoint at ``path`` (its metadata read and checked),
    its files still to be added. The license, unless given, is a GGUF's ``general.license``."""
    info, _ = model_info(path)
    if license is None and path.is_file():
        with read_gguf(path) as gguf:
            found = gguf.metadata.get("general.license")
            license = found if isinstance(found, str) else None
    return ModelRecord(
        name=name, format=str(info["format"]),
        architecture=str(info["architecture"]), quantization=str(info["quantization"]),
        parameters=int(info["parameters"]), active_parameters=int(info["active_parameters"]),  # type: ignore[call-overload]
        context_length=int(info["context_length"]), size=0, source=source, license=license,  # type: ignore[call-overload]
    )


def register(registry: Registry, name: ModelName, files: list[ModelFile], source: str,
             license: str | None = None) -> ModelRecord:
    """Register a model whose blobs are all in the store. Its metadata is read first,
    through a staging folder of links, so a model the engine could not open is not
    listed; the blobs no model uses are then deleted again."""
    for file in files:
        check_file_name(file.name)
    ggufs = sorted(f.name for f in files if f.name.lower().endswith(".gguf") and f.role == "weights")
    try:
        with tempfile.TemporaryDirectory(dir=registry.home, prefix="staging-") as staging:
            for file in files:
                os.symlink(registry.blobs.path(file.digest), Path(staging, file.name))
            entry = Path(staging, ggufs[0]) if ggufs else Path(staging)
            record = record_for(entry, name, source, license)
        record.files = list(files)
        record.size = sum(f.size for f in files)
        return registry.add(record)
    except BaseException:
        registry.forget_unused(f.digest for f in files)
        raise


def import_local(registry: Registry, path: Path, name: str | None = None) -> ModelRecord:
    """Copy the checkpoint at ``path`` into the store and register it (default name: the
    file or folder name)."""
    path = path.expanduser()
    if not path.exists():
        raise LocalserveError(f"{path}: no such file or folder")
    model_name = parse_name(name) if name else default_name(path)
    model_info(path)  # a broken or unsupported checkpoint fails here, before anything is copied
    if path.is_file():
        sources = split_paths(path)  # a split GGUF's other parts come along
    else:
        sources = sorted(p for p in path.iterdir() if p.is_file() and role_of(p.name))
    files = [ModelFile(source.name, registry.blobs.add_file(source), source.stat().st_size,
                       "weights" if path.is_file() else role_of(source.name) or "other") for source in sources]
    return register(registry, model_name, files, f"file:{path.resolve()}")
