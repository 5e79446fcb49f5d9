"""``localserve create`` and ``/api/create``: a model made from another with its own
defaults (settings.py), as Ollama's Modelfile makes one.

The new model shares its base's blobs; only its settings (and a LICENSE it declares) are
new blobs. A base that is itself a made model passes its settings on: the Modelfile's
parameters are merged over them, and its SYSTEM, TEMPLATE and MESSAGE lines replace the
base's. A base that is a file or folder is copied into the store first, like ``pull``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from ..errors import LocalserveError
from ..text.chat_template import ChatTemplate
from .local import local_source, register, store_local
from .modelfile import Modelfile
from .names import parse_name
from .registry import ModelFile, ModelRecord, Registry
from .settings import ModelSettings

_SAMPLE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
           {"role": "user", "content": "u"}]


def check_template(source: str) -> None:
    """Refuse a TEMPLATE that is not a Jinja chat template able to render a conversation."""
    try:
        ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(_SAMPLE)
    except LocalserveError as exc:
        hint = (" (it reads like one of Ollama's Go templates; localserve's TEMPLATE is a Jinja chat "
                "template, as Hugging Face checkpoints have)" if "{{ ." in source or "{{." in source else "")
        raise LocalserveError(f"TEMPLATE: {str(exc).splitlines()[0]}{hint}") from None


def base_path(base: str, folder: Path | None, local_roots: Sequence[Path] | None = None) -> Path | None:
    """FROM as a file or folder, or None for a registry name. A relative path is looked
    for in ``folder`` (the Modelfile's); with no folder (``/api/create``) only an
    absolute path is one, and only below ``local_roots`` (see ``local_source``)."""
    path = Path(base).expanduser()
    if not path.is_absolute():
        if folder is None:
            return None
        path = folder / path
    found = local_source(str(path), local_roots)
    if found is not None:
        return found
    if Path(base).expanduser().is_absolute() or base.startswith(("./", "../")) or base.lower().endswith(".gguf"):
        raise LocalserveError(f"FROM {base[:200]}: no such file or folder")
    return None


def create_model(registry: Registry, name: str, modelfile: Modelfile, folder: Path | None = None,
                 local_roots: Sequence[Path] | None = None) -> ModelRecord:
    """Register ``name`` as ``modelfile`` makes it. ``folder``: where a FROM path is looked
    for (the Modelfile's folder; None takes FROM as a registry name or an absolute path);
    ``local_roots``: the folders a FROM path may be in (None: anywhere)."""
    target = parse_name(name)
    if modelfile.settings.template is not None:
        check_template(modelfile.settings.template)  # before anything is copied
    path = base_path(modelfile.base, folder, local_roots)
    if path is not None:
        base, files = store_local(registry, path, target)
        inherited = ModelSettings()
    else:
        base = registry.get(modelfile.base)
        files, inherited = list(base.files), registry.settings(base)
    settings = modelfile.settings.over(inherited)
    try:
        files = [f for f in files if f.role != "settings" and not (modelfile.licenses and f.role == "license")]
        if settings:
            files.append(registry.settings_file(settings))
        license = base.license
        if modelfile.licenses:
            text = "\n\n".join(modelfile.licenses).encode()
            files.append(ModelFile("LICENSE", registry.blobs.add_bytes(text), len(text), "license"))
            license = next((line.strip() for line in modelfile.licenses[0].splitlines() if line.strip()), "")[:100]
    except BaseException:
        registry.forget_unused(f.digest for f in files)
        raise
    record = replace(base, name=target, created="", last_used=None, license=license or None,
                     source=f"created from {modelfile.base}" if path is None else base.source)
    return register(registry, record, files)
