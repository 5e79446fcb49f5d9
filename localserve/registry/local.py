"""Importing a local checkpoint (a .gguf file or an HF folder) into the registry."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import LocalserveError
from ..model_info import model_info
from .names import ModelName, parse_name
from .registry import ModelFile, ModelRecord, Registry

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


def record_for(path: Path, name: ModelName, source: str) -> ModelRecord:
    """The catalogue row for the checkpoint at ``path`` (its metadata read and checked),
    its files still to be added."""
    info, _ = model_info(path)
    return ModelRecord(
        name=name, format="safetensors" if info["format"] == "hf" else str(info["format"]),
        architecture=str(info["architecture"]), quantization=str(info["quantization"]),
        parameters=int(info["parameters"]), active_parameters=int(info["active_parameters"]),  # type: ignore[call-overload]
        context_length=int(info["context_length"]), size=0, source=source,  # type: ignore[call-overload]
    )


def import_local(registry: Registry, path: Path, name: str | None = None) -> ModelRecord:
    """Copy the checkpoint at ``path`` into the store and register it (default name: the
    file or folder name). Its metadata is read first, so a broken file registers nothing."""
    path = path.expanduser()
    if not path.exists():
        raise LocalserveError(f"{path}: no such file or folder")
    model_name = parse_name(name) if name else default_name(path)
    record = record_for(path, model_name, f"file:{path.resolve()}")
    sources = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file() and role_of(p.name))
    for source in sources:
        role = "weights" if path.is_file() else role_of(source.name)
        digest = registry.blobs.add_file(source)
        record.files.append(ModelFile(source.name, digest, source.stat().st_size, role or "other"))
    record.size = sum(f.size for f in record.files)
    return registry.add(record)
