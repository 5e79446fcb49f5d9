"""Pulling a model from the Hugging Face Hub: ``hf.co/<owner>/<repo>[:<tag>]``.

huggingface_hub supplies the endpoint (``HF_ENDPOINT``), the token (``HF_TOKEN`` or
``hf auth login``), offline mode (``HF_HUB_OFFLINE``) and the repo listing with each
file's size and digest; the bytes come through ``download`` so every pull, Hub or
URL, resumes and verifies the same way.

Which files: in a GGUF repo the tag picks one quantization (``Q4_K_M`` by default,
case-insensitive, or a file name), with all the parts of a split file. In any other
repo: the config, every safetensors shard, the tokenizer, generation config and
chat template files at the top level (pickled weights are never fetched). There
the tag, if any, names a revision (branch, tag or commit).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import httpx

from ..errors import LocalserveError
from .download import RemoteFile
from .local import role_of
from .names import ModelName, parse_name

DEFAULT_QUANT = "Q4_K_M"
_PREFIXES = ("hf.co/", "huggingface.co/", "https://hf.co/", "https://huggingface.co/")
_REPO_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHA1 = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True, slots=True)
class HubSource:
    repo: str  # owner/name
    tag: str | None


@dataclass(frozen=True, slots=True)
class RepoFile:
    path: str  # inside the repo, '/'-separated
    size: int | None = None
    sha256: str | None = None
    git_sha1: str | None = None

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name

    @property
    def digest(self) -> str | None:
        """The blob store's name for it, when the Hub published its sha256."""
        return f"sha256-{self.sha256}" if self.sha256 else None


@dataclass(slots=True)
class HubPlan:
    """What a Hub pull fetches, and the name it registers."""

    name: ModelName
    revision: str  # the commit, so every file comes from the same one
    files: list[RepoFile]
    license: str | None


def parse_hub_source(text: str) -> HubSource | None:
    """``hf.co/owner/repo[:tag]`` (or huggingface.co/...), else None."""
    lowered = text.lower()
    prefix = next((p for p in _PREFIXES if lowered.startswith(p)), None)
    if prefix is None:
        return None
    rest = text[len(prefix):]
    repo, _, tag = rest.partition(":")
    parts = repo.strip("/").split("/")
    if prefix.startswith("https://") and len(parts) != 2:
        return None  # a file's URL (.../resolve/main/x.gguf): pulled as a URL
    if len(parts) != 2 or not all(_REPO_PART.fullmatch(p) and ".." not in p for p in parts):
        raise LocalserveError(f"{text!r} is not a Hub model: use hf.co/<owner>/<repo>[:<tag>]")
    if tag and (len(tag) > 200 or ".." in tag or tag.startswith("/") or "\\" in tag or "\0" in tag):
        raise LocalserveError(f"{tag!r} is not a tag: use a quantization (Q4_K_M), a file name or a revision")
    return HubSource("/".join(parts), tag or None)


def check_repo_path(path: str) -> str:
    """A file path the Hub listed: relative, no '..', nothing strange."""
    parts = path.split("/")
    if (not path or len(path) > 1000 or path.startswith("/") or "\\" in path or "\0" in path
            or any(p in ("", ".", "..") for p in parts)):
        raise LocalserveError(f"the repo lists a file with an unacceptable path {path[:80]!r}; refusing it")
    return path


# -- choosing files ------------------------------------------------------------------------


def is_projector_name(path: str) -> bool:
    """A vision projector file by its name (llama.cpp's converter: ``mmproj-*.gguf``)."""
    name = PurePosixPath(path).name.lower()
    return name.endswith(".gguf") and "mmproj" in name


def _is_weights_gguf(path: str) -> bool:
    return path.lower().endswith(".gguf") and not is_projector_name(path)  # vision projectors are not the model


# Which projector to take when a repo has several, best first: the quantization the model
# was pulled in, then F16 (what llama.cpp's converter writes by default), BF16, F32, Q8_0.
_PROJECTOR_PREFERENCE = ("f16", "bf16", "f32", "q8_0")


def choose_projector(files: list[RepoFile], label: str) -> list[RepoFile]:
    """The repo's vision projector for a model pulled as ``label`` (none: [])."""
    projectors = sorted((f for f in files if is_projector_name(f.path)), key=lambda f: f.path)
    if len(projectors) <= 1:
        return projectors
    for wanted in (label.lower(), *_PROJECTOR_PREFERENCE):
        matching = [f for f in projectors if _quant_pattern(wanted).search(f.name.lower())]
        if matching:
            return matching[:1]
    return projectors[:1]


def _quant_pattern(tag: str) -> re.Pattern[str]:
    # The tag as a whole token of the path: Q4_K matches "x-Q4_K.gguf", not "x-Q4_K_M.gguf".
    return re.compile(rf"(?<![a-z0-9_]){re.escape(tag.lower())}(?![a-z0-9_])")


def _model_key(path: str) -> str:
    """The file a split part belongs to: the path without its -0000k-of-0000n."""
    return _SPLIT.sub(".gguf", path.lower())


def choose_gguf(files: list[RepoFile], tag: str | None) -> tuple[list[RepoFile], str]:
    """The files of the quantization ``tag`` names (default Q4_K_M), and the tag to register."""
    ggufs = [f for f in files if _is_weights_gguf(f.path)]
    wanted = tag or DEFAULT_QUANT
    exact = [f for f in ggufs if wanted.lower() in (f.path.lower(), f.name.lower())]
    if exact:
        key = _model_key(exact[0].path)
        label = _label_of(exact[0].name, wanted)
    else:
        matching = {_model_key(f.path) for f in ggufs if _quant_pattern(wanted).search(f.path.lower())}
        if len(matching) != 1:
            listed = ", ".join(sorted({_SPLIT.sub(".gguf", f.path) for f in ggufs})) or "none"
            problem = "matches several files" if matching else "matches no file"
            hint = "" if tag else f" (no {DEFAULT_QUANT} here: add :<quantization> to the name)"
            raise LocalserveError(f"{wanted!r} {problem} in this repo{hint}; its GGUF files: {listed}")
        key = matching.pop()
        label = wanted
    chosen = sorted((f for f in ggufs if _model_key(f.path) == key), key=lambda f: f.path)
    _check_split_complete(chosen)
    return chosen, label.lower()


def _label_of(file_name: str, fallback: str) -> str:
    """The quantization named in a file name (``...-Q4_K_M.gguf`` -> Q4_K_M, ``IQ4_XS``,
    ``TQ1_0``), else the stem."""
    found = re.findall(r"(?<![a-z0-9])([it]?q\d[a-z0-9_]*|bf16|f16|f32)(?![a-z0-9])", _model_key(file_name))
    return found[-1] if found else _SPLIT.sub("", fallback).removesuffix(".gguf")


def _check_split_complete(chosen: list[RepoFile]) -> None:
    parts = [_SPLIT.search(f.path) for f in chosen]
    if len(chosen) == 1 and parts[0] is None:
        return
    if any(p is None for p in parts):
        raise LocalserveError("the chosen quantization mixes split and whole GGUF files: name one file")
    count = int(parts[0].group(2))  # type: ignore[union-attr]
    numbers = sorted(int(p.group(1)) for p in parts)  # type: ignore[union-attr]
    if numbers != list(range(1, count + 1)) or any(int(p.group(2)) != count for p in parts):  # type: ignore[union-attr]
        raise LocalserveError(f"the repo has parts {numbers} of a GGUF split in {count}: some are missing")


def choose_checkpoint_files(files: list[RepoFile]) -> list[RepoFile]:
    """An HF checkpoint's files: top-level config, safetensors, tokenizer, template, license."""
    chosen = [f for f in files if "/" not in f.path and role_of(f.path)]
    names = {f.path for f in chosen}
    if "config.json" not in names:
        raise LocalserveError("this repo has neither GGUF files nor a config.json at its top level; "
                              "it is not a model localserve can load")
    if not any(name.endswith(".safetensors") for name in names):
        pickled = [f.path for f in files if f.path.endswith((".bin", ".pt", ".pth"))]
        why = " (it has only pickled weights, which localserve never loads)" if pickled else ""
        raise LocalserveError(f"this repo has no .safetensors weights{why}")
    return chosen


def plan_pull(source: HubSource, revision: str, files: list[RepoFile], license: str | None,
              name: str | None) -> HubPlan:
    """Which files to fetch and the name: for GGUF ``<repo without -GGUF>:<quant>``,
    else ``<repo>:latest`` (or ``:<revision>``)."""
    repo_name = re.sub(r"[-_.]gguf$", "", source.repo.split("/")[1], flags=re.IGNORECASE)
    if is_gguf_repo(files):
        chosen, tag = choose_gguf(files, source.tag)
        chosen += choose_projector(files, tag)
    else:
        chosen, tag = choose_checkpoint_files(files), (source.tag or "latest")
    if len({f.name for f in chosen}) != len(chosen):
        raise LocalserveError("the chosen files have clashing names in different folders; name one file")
    model_name = parse_name(name) if name else parse_name(f"{_clean(repo_name)}:{_clean(tag)}")
    return HubPlan(model_name, revision, chosen, license)


def _clean(text: str) -> str:
    cleaned = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._")
    return cleaned[:128] or "model"


# -- talking to the Hub -------------------------------------------------------------------


def hub_endpoint() -> str:
    """``HF_ENDPOINT`` as set now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES",
                                                                                                  "TRUE"))


def is_gguf_repo(files: list[RepoFile]) -> bool:
    return any(_is_weights_gguf(f.path) for f in files)


def list_repo(source: HubSource, revision: str | None) -> tuple[str, list[RepoFile], str | None]:
    """The repo's commit, files (with sizes and digests) and license, from the Hub."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    try:
        info = HfApi(endpoint=hub_endpoint()).model_info(source.repo, revision=revision, files_metadata=True)
    except GatedRepoError as exc:
        raise LocalserveError(f"hf.co/{source.repo} is gated: accept its terms on the Hub and set HF_TOKEN") from exc
    except RepositoryNotFoundError as exc:
        raise LocalserveError(f"hf.co/{source.repo}: no such repo (or it is private: set HF_TOKEN)") from exc
    except RevisionNotFoundError as exc:
        raise LocalserveError(f"hf.co/{source.repo}: no revision {revision!r} (and it is not a GGUF repo, where "
                              "the tag would pick a quantization)") from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise LocalserveError(f"hf.co/{source.repo}: access denied (HTTP {status}); a private or gated repo needs "
                                  "a token: set HF_TOKEN or run `hf auth login`") from exc
        raise LocalserveError(f"hf.co/{source.repo}: the Hub answered {str(exc).splitlines()[0]}") from exc
    except (OSError, httpx.HTTPError) as exc:  # connection refused, DNS, timeouts
        raise LocalserveError(f"cannot reach {hub_endpoint()}: {exc}") from exc
    files = [_repo_file(sibling) for sibling in info.siblings or []]
    license = (info.card_data or {}).get("license") if info.card_data is not None else None
    return str(info.sha), files, str(license) if license else None


def _repo_file(sibling: object) -> RepoFile:
    path = check_repo_path(str(getattr(sibling, "rfilename", "")))
    lfs = getattr(sibling, "lfs", None)
    sha256 = getattr(lfs, "sha256", None) if lfs is not None else None
    blob_id = getattr(sibling, "blob_id", None)
    if sha256 is not None and not _SHA256.fullmatch(str(sha256)):
        raise LocalserveError(f"the repo gives {path} a malformed sha256 {str(sha256)[:80]!r}; refusing it")
    size = getattr(sibling, "size", None)
    if size is not None and (not isinstance(size, int) or size < 0):
        raise LocalserveError(f"the repo gives {path} a malformed size; refusing it")
    git_sha1 = str(blob_id) if sha256 is None and blob_id and _SHA1.fullmatch(str(blob_id)) else None
    return RepoFile(path, size, sha256, git_sha1)


def remote_files(source: HubSource, plan: HubPlan) -> list[RemoteFile]:
    from huggingface_hub import hf_hub_url

    return [RemoteFile(url=hf_hub_url(source.repo, f.path, revision=plan.revision, endpoint=hub_endpoint()),
                       name=f.path, size=f.size, digest=f.digest, git_sha1=f.git_sha1) for f in plan.files]


def auth_headers() -> dict[str, str]:
    from huggingface_hub.utils import build_hf_headers

    return dict(build_hf_headers(library_name="localserve"))


def cached_snapshot(source: HubSource, revision: str | None) -> tuple[Path, list[RepoFile]]:
    """Offline: the repo's files as the Hugging Face cache holds them (at ``main``, or
    ``revision``), whatever part of the repo was downloaded."""
    from huggingface_hub import constants, scan_cache_dir

    wanted = revision or "main"
    cache = Path(constants.HF_HUB_CACHE)
    repos = scan_cache_dir(cache).repos if cache.is_dir() else frozenset()
    for repo in repos:
        if repo.repo_type != "model" or repo.repo_id.lower() != source.repo.lower():
            continue
        for cached in repo.revisions:
            if wanted in cached.refs or cached.commit_hash == wanted:
                folder = Path(cached.snapshot_path)
                files = [RepoFile(check_repo_path(f.file_path.relative_to(folder).as_posix()), f.size_on_disk)
                         for f in sorted(cached.files, key=lambda f: f.file_path)]
                return folder, files
    raise LocalserveError(f"offline (HF_HUB_OFFLINE is set) and hf.co/{source.repo} at {wanted} is not in the "
                          f"Hugging Face cache ({cache})")
