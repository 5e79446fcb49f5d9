"""``localserve pull SOURCE``: from the Hub, a URL or a local file or folder into the store.

Every file lands in the blob store verified (size, and the digest the source
publishes, when it does), and the model is registered only once all of them are
there, so an interrupted or corrupt pull never shows up in ``localserve list``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlparse

from rich.progress import Progress

from ..errors import LocalserveError
from . import hub
from .blobs import expected_digest
from .download import DEFAULT_MAX_FILE_BYTES, RemoteFile, download
from .local import default_name, import_local, local_source, register_fetched, role_of
from .names import parse_name
from .registry import ModelFile, ModelRecord, Registry, check_file_name


def pull(registry: Registry, source: str, name: str | None = None, sha256: str | None = None,
         progress: Progress | None = None, max_bytes: int = DEFAULT_MAX_FILE_BYTES,
         local_roots: Sequence[Path] | None = None, mmproj: str | None = None) -> ModelRecord:
    """Pull ``source``: ``hf.co/<owner>/<repo>[:<tag>]`` (with its vision projector when
    the repo has one), an ``https://`` URL of a .gguf file, or a local .gguf file (with
    ``mmproj``, a local projector file) or model folder (with ``local_roots``, only one
    below those folders: see ``local_source``); no file may be larger than ``max_bytes``."""
    if mmproj is not None:
        path, projector = local_source(source, local_roots), local_source(mmproj, local_roots)
        if path is None or projector is None:
            raise LocalserveError("--mmproj goes with a local .gguf model file, and names a local projector file")
        return import_local(registry, path, name, sha256, max_bytes, projector)
    if (hub_source := hub.parse_hub_source(source)) is not None:
        return pull_hub(registry, hub_source, name, progress, max_bytes)
    if re.match(r"https?://", source, re.IGNORECASE):
        return pull_url(registry, source, name, sha256, progress, max_bytes)
    path = local_source(source, local_roots)
    if path is not None:
        return import_local(registry, path, name, sha256, max_bytes)
    raise LocalserveError(f"{source[:200]!r} is neither a file or folder here, nor hf.co/<owner>/<repo>[:<tag>], "
                          "nor an https:// URL")


def pull_hub(registry: Registry, source: hub.HubSource, name: str | None = None,
             progress: Progress | None = None, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> ModelRecord:
    if hub.offline():
        return _import_cached(registry, source, name)
    revision, files, license = hub.list_repo(source, None)
    if source.tag and not hub.is_gguf_repo(files):
        revision, files, license = hub.list_repo(source, source.tag)  # the tag names a revision
    plan = hub.plan_pull(source, revision, files, license, name)
    headers = hub.auth_headers()
    digests = [download(registry.blobs, remote, headers, progress, max_bytes=max_bytes)
               for remote in hub.remote_files(source, plan)]
    return register_fetched(registry, plan.name, _model_files(registry, plan, digests),
                            f"hf.co/{source.repo}@{revision}", license)


def _import_cached(registry: Registry, source: hub.HubSource, name: str | None) -> ModelRecord:
    """Offline: the same choice of files, from the Hugging Face cache."""
    folder, files = hub.cached_snapshot(source, None)
    if source.tag and not hub.is_gguf_repo(files):
        folder, files = hub.cached_snapshot(source, source.tag)
    plan = hub.plan_pull(source, folder.name, files, None, name)
    digests = [registry.blobs.add_file(folder / file.path, file.digest) for file in plan.files]
    return register_fetched(registry, plan.name, _model_files(registry, plan, digests),
                            f"hf.co/{source.repo}@{folder.name}")


def _model_files(registry: Registry, plan: hub.HubPlan, digests: list[str]) -> list[ModelFile]:
    return [ModelFile(file.name, digest, registry.blobs.path(digest).stat().st_size, _role(file.name))
            for file, digest in zip(plan.files, digests, strict=True)]


def _role(file_name: str) -> str:
    if file_name.lower().endswith(".gguf"):
        return "projector" if hub.is_projector_name(file_name) else "weights"
    return role_of(file_name) or "other"


def progress_bar() -> Progress:
    """Bytes, speed and time left per file, as the CLI shows a pull."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    # On stderr, so `pull --json` leaves stdout to the JSON.
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True))


def pull_url(registry: Registry, url: str, name: str | None = None, sha256: str | None = None,
             progress: Progress | None = None, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> ModelRecord:
    """One .gguf file from a URL; ``sha256`` (hex, or sha256-hex) is checked when given."""
    parsed = urlparse(url)
    if parsed.scheme.lower() not in ("http", "https") or not parsed.netloc:
        raise LocalserveError(f"{url[:200]!r} is not an http(s) URL")
    file_name = check_file_name(unquote(PurePosixPath(parsed.path).name))
    if not file_name.lower().endswith(".gguf"):
        raise LocalserveError(f"{file_name!r}: a URL pull takes one .gguf file; for an HF checkpoint use "
                              "hf.co/<owner>/<repo>")
    expected = None
    if sha256:
        expected = expected_digest(sha256)
    digest = download(registry.blobs, RemoteFile(url, file_name, digest=expected), progress=progress,
                      max_bytes=max_bytes)
    model_name = parse_name(name) if name else default_name(Path(file_name))
    size = registry.blobs.path(digest).stat().st_size
    return register_fetched(registry, model_name, [ModelFile(file_name, digest, size, "weights")], url)
