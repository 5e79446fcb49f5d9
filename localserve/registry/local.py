"""Importing a local checkpoint (a .gguf file or an HF folder) into the registry."""

from __future__ import annotations

import os
import re
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..errors import LocalserveError
from ..formats import Checkpoint, open_checkpoint, open_gguf
from ..facts.checkpoint import check_images, model_info
from .blobs import expected_digest
from .download import DEFAULT_MAX_FILE_BYTES
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


def model_files(folder: Path) -> list[Path]:
    """The files of an HF folder that a model needs, each a regular file inside the folder
    (``check_inside``)."""
    files = []
    for entry in sorted(folder.iterdir()):
        if role_of(entry.name) is None:
            continue
        if entry.is_dir() and not entry.is_symlink():
            continue  # a folder that happens to match a file name
        check_inside(folder, entry)
        files.append(entry)
    return files


def check_inside(folder: Path, entry: Path) -> None:
    """A link may point within the folder, or (Hugging Face's cache) from a snapshot into
    its repository's blobs; a link anywhere else (``LICENSE -> /etc/passwd``) refuses the
    import, so nothing outside what the user named is ever read or stored."""
    root = folder.resolve()
    allowed = [root]
    if root.parent.name == "snapshots":
        allowed.append(root.parent.parent / "blobs")
    target = entry.resolve()
    if not any(target.is_relative_to(place) for place in allowed):
        raise LocalserveError(f"{entry}: a link to {target}, outside the model's folder; refusing to import it")
    if not target.is_file():
        raise LocalserveError(f"{entry}: not a regular file; refusing to import it")


def default_name(path: Path) -> ModelName:
    """The file or folder name, lowercased, with what a name may not hold replaced."""
    stem = path.name.removesuffix(".gguf").lower()
    cleaned = re.sub(r"[^a-z0-9._-]+", "-", stem).strip("-._") or "model"
    return parse_name(cleaned[:128])


def record_for(checkpoint: Checkpoint, name: ModelName, source: str, license: str | None = None) -> ModelRecord:
    """The catalogue row for ``checkpoint``, its files still to be added: only once it
    passes what every load checks first (``Checkpoint.check_loadable``: tensors from the
    headers, no weights read; tokenizer; chat template) and its image settings read. The
    license, unless given, is a GGUF's ``general.license``."""
    checkpoint.check_loadable()
    check_images(checkpoint)
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
    with_projector = any(f.role == "projector" for f in files)
    try:
        with tempfile.TemporaryDirectory(dir=registry.home, prefix="staging-") as staging:
            for file in files:
                os.symlink(registry.blobs.path(file.digest), Path(staging, check_file_name(file.name)))
            # A GGUF model with a projector opens as their folder (formats/mmproj.py).
            entry = Path(staging, ggufs[0]) if ggufs and not with_projector else Path(staging)
            record = record_for(open_checkpoint(entry), name, source, license)
    except BaseException:
        registry.forget_unused(f.digest for f in files)
        raise
    return register(registry, record, files)


def local_source(source: str, allowed_roots: Sequence[Path] | None = None) -> Path | None:
    """The file or folder ``source`` names, or None when it names none.

    ``allowed_roots`` None reads any path (the CLI: its user's own files). Otherwise the
    daemon pulls for an HTTP client, and only below the folders its operator listed
    (``serve --allow-pull-from DIR``; none by default, as Ollama's pull API reads no local
    files): the path must be absolute and, links resolved, inside one of them. Outside,
    the refusal reads the same whether or not the path exists, so a client learns nothing
    about the server's files."""
    path = Path(source).expanduser()
    if allowed_roots is not None:
        resolved = path.resolve()
        if not path.is_absolute() or not any(resolved.is_relative_to(root.resolve()) for root in allowed_roots):
            where = (f"only below {', '.join(str(root) for root in allowed_roots)}" if allowed_roots
                     else "none (`localserve serve --allow-pull-from DIR` allows a folder)")
            raise LocalserveError(f"{source[:200]!r}: not a source this server pulls from; over HTTP a pull takes "
                                  f"hf.co/<owner>/<repo>[:<tag>] or an https:// URL, and local paths {where}")
        path = resolved
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:  # a name too long, a loop of links, no permission
        raise LocalserveError(f"{source[:200]!r}: cannot read it ({exc.strerror})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        # A device (/dev/zero), a pipe (/dev/stdin, a FIFO) or a socket would be read for ever or block.
        raise LocalserveError(f"{source[:200]!r}: not a regular file or a folder")
    return path


def import_local(registry: Registry, path: Path, name: str | None = None, sha256: str | None = None,
                 max_bytes: int = DEFAULT_MAX_FILE_BYTES, mmproj: Path | None = None) -> ModelRecord:
    """Copy the checkpoint at ``path`` into the store and register it (default name: the
    file or folder name). Its metadata is read before anything is copied, so a broken or
    unsupported checkpoint registers nothing. ``sha256`` checks a single file, as a URL
    pull does; no file may be larger than ``max_bytes``. ``mmproj``: a .gguf model's
    vision projector file, stored with it."""
    path = path.expanduser()
    model_name = parse_name(name) if name else default_name(path)
    return register(registry, *store_local(registry, path, model_name, sha256, max_bytes, mmproj))


def store_local(registry: Registry, path: Path, name: ModelName, sha256: str | None = None,
                max_bytes: int = DEFAULT_MAX_FILE_BYTES, mmproj: Path | None = None,
                ) -> tuple[ModelRecord, list[ModelFile]]:
    """The record of the checkpoint at ``path`` and its files, copied into the blob store
    (not registered yet); nothing is copied unless its metadata reads."""
    if local_source(str(path)) is None:
        raise LocalserveError(f"{path}: no such file or folder")
    expected = None
    if sha256:
        if not path.is_file():
            raise LocalserveError("--sha256 checks one file; a folder holds several (each is hashed as it is stored)")
        expected = expected_digest(sha256)
    if mmproj is not None:
        if not path.is_file() or local_source(str(mmproj)) is None or not mmproj.expanduser().is_file():
            raise LocalserveError("--mmproj names a vision projector file, for a .gguf model file")
        checkpoint = open_gguf(path, mmproj.expanduser())
    else:
        gguf_folder = path.is_dir() and not (path / "config.json").exists()
        folder_files = model_files(path) if path.is_dir() and not gguf_folder else None  # checked before reading
        checkpoint = open_checkpoint(path)
    record = record_for(checkpoint, name, f"file:{path.resolve()}")
    roles: dict[Path, str] = {}
    if checkpoint.gguf is not None:
        roles = dict.fromkeys(checkpoint.gguf.paths, "weights")  # a split GGUF's parts too
        if checkpoint.mmproj is not None:
            roles[checkpoint.mmproj.path] = "projector"
        if path.is_dir():
            for source in roles:
                check_inside(path, source)
    else:  # only the shards the checkpoint reads: not every .safetensors file lying beside them
        assert folder_files is not None
        roles = {file: role_of(file.name) or "other" for file in folder_files
                 if role_of(file.name) != "weights" or file.suffix != ".safetensors" or file in checkpoint.files}
    for source in roles:
        if (size := source.stat().st_size) > max_bytes:
            raise LocalserveError(f"{source.name} is {size:,} bytes, over the limit of {max_bytes:,} (--max-size)")
    files = [ModelFile(source.name, registry.blobs.add_file(source, expected if source == path else None),
                     source.stat().st_size, role) for source, role in roles.items()]
    return record, files
