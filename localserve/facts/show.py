"""``localserve show``: a model's metadata (``model_info``) with what the registry and
the checkpoint add: its chat template, license and files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..formats import Checkpoint, open_checkpoint
from .checkpoint import model_info
from ..registry import ModelRecord, open_registry
from ..registry.local import model_files, role_of
from ..registry.modelfile import modelfile_of
from ..registry.settings import ModelSettings

_LICENSE_TEXT_LIMIT = 1 << 20


def model_facts(model: str) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The facts of ``model`` (a path, else a registry name) as a dict and as labelled lines."""
    path = Path(model).expanduser()
    record: ModelRecord | None = None
    settings = ModelSettings()
    if not path.exists():
        registry = open_registry()
        record = registry.get(model)
        path = registry.path(record.name)
        settings = registry.settings(record)
    # A folder the user names is checked before anything is read; the registry's own are links into its store.
    folder_files = model_files(path) if record is None and path.is_dir() else None
    checkpoint = open_checkpoint(path)
    info, lines = model_info(checkpoint)
    files = _files(checkpoint, record, folder_files)
    chat_template = checkpoint.chat_template_or_none(settings.template)
    template = chat_template.source if chat_template is not None else None
    license_text = _license_text(path, files)
    license = (record.license if record else None) or info["license"]
    facts: dict[str, Any] = {
        **info, "name": str(record.name) if record else None, "source": record.source if record else None,
        "created": record.created if record else None, "last_used": record.last_used if record else None,
        "template": template, "license": license, "license_text": license_text, "files": files,
        "settings": settings.as_dict(), "parameter_lines": settings.parameter_lines(),
        "modelfile": modelfile_of(str(record.name) if record else model, str(path), settings),
    }
    if record is not None:
        lines.insert(0, ("name", str(record.name)))
        lines.append(("source", record.source))
    count = len(template.splitlines()) if template else 0
    lines.append(("template", f"{count} line{'s' * (count != 1)} (show --template prints it)" if template
                  else "none (prompts are completed as plain text)"))
    lines.append(("license", (license or "not declared") + (" (show --license prints it)" if license_text else "")))
    lines += [("defaults" if i == 0 else "", line) for i, line in enumerate(settings.parameter_lines())]
    if settings.system is not None:
        lines.append(("system", settings.system if len(settings.system) <= 80 else settings.system[:77] + "..."))
    if settings.messages:
        lines.append(("messages", f"{len(settings.messages)} (show --modelfile prints them)"))
    lines += [("file" if i == 0 else "", f"{f['name']}  {f['role']}  {f['size']} bytes") for i, f in enumerate(files)]
    return facts, lines


def _files(checkpoint: Checkpoint, record: ModelRecord | None, folder_files: list[Path] | None) -> list[dict[str, Any]]:
    if record is not None:
        return [{"name": f.name, "role": f.role, "size": f.size, "digest": f.digest} for f in record.files]
    if checkpoint.gguf is not None:
        return [{"name": p.name, "role": "weights", "size": p.stat().st_size, "digest": None}
                for p in checkpoint.gguf.paths]  # every part of a split GGUF
    return [{"name": p.name, "role": role_of(p.name), "size": p.stat().st_size, "digest": None}
            for p in folder_files or []]


def _license_text(path: Path, files: list[dict[str, Any]]) -> str | None:
    names = [f["name"] for f in files if f["role"] == "license"]
    if not names:
        return None
    folder = path if path.is_dir() else path.parent
    with open(folder / names[0], "rb") as reader:
        return reader.read(_LICENSE_TEXT_LIMIT).decode("utf-8", errors="replace")
