"""Downloading one file into the blob store: resumable, verified, with a progress bar.

The bytes go to ``blobs/partial-<key>`` (the key is the expected digest, else a hash
of the URL), so a pull that stops, for whatever reason, leaves what it had; the next
pull asks only for the rest (HTTP ``Range``, with ``If-Range`` so a file that changed
on the server starts over instead of being spliced). Only a complete download whose
size and digest check out is moved into place under its digest.
"""

from __future__ import annotations

import fcntl
import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.progress import Progress, TaskID

from ..errors import LocalserveError
from .blobs import BlobStore, check_digest

_CHUNK = 1 << 20
_TIMEOUT = httpx.Timeout(30.0, read=60.0)
# The largest file a pull takes unless told otherwise: the Hub's own per-file limit is 50 GB
# (bigger models come split), so more is a mistake or a server that never stops sending.
DEFAULT_MAX_FILE_BYTES = 64 << 30


@dataclass(frozen=True, slots=True)
class RemoteFile:
    """A file to fetch and what is known of it beforehand."""

    url: str
    name: str  # shown in the progress bar and in errors
    size: int | None = None
    digest: str | None = None  # sha256-<hex>, when the source publishes it
    git_sha1: str | None = None  # the git blob id (the Hub's id for files not in LFS)


class DownloadError(LocalserveError):
    """A download failed; what arrived is kept for the next attempt."""


def download(store: BlobStore, remote: RemoteFile, headers: dict[str, str] | None = None,
             progress: Progress | None = None, retries: int = 3, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> str:
    """Fetch ``remote`` into ``store`` and return its digest. A dropped connection is
    resumed up to ``retries`` times; after that the partial file stays for the next pull.
    A file larger than ``max_bytes`` (by its Content-Length, or as it arrives) is refused
    and what arrived deleted."""
    if remote.digest is not None:
        check_digest(remote.digest)
    key = remote.digest or "url-" + hashlib.sha256(remote.url.encode()).hexdigest()
    if remote.digest is not None and store.has(remote.digest):
        return remote.digest  # another model (or an earlier pull) has it already
    partial = store.partial_path(key)
    with _exclusive(partial), httpx.Client(timeout=_TIMEOUT, follow_redirects=True) as client:
        task = None
        if progress is not None:
            progress.start()  # shown from the first download on (a local import shows no bar)
            task = progress.add_task(remote.name, total=remote.size)
        for attempt in range(retries + 1):
            try:
                _fetch(client, remote, partial, headers or {}, progress, task, max_bytes)
                break
            except (httpx.TransportError, _Retry) as exc:
                if attempt == retries:
                    have = partial.stat().st_size if partial.exists() else 0
                    raise DownloadError(f"{remote.name}: download failed ({exc}); {have} bytes are kept and the "
                                        "same pull resumes from there") from exc
                time.sleep(0.2 * (attempt + 1))
        try:
            _check_size(partial, remote)
            if remote.git_sha1 is not None:
                _check_git_sha1(partial, remote)
            return store.commit_partial(partial, remote.digest, remote.name)
        finally:
            if not partial.exists():  # committed, or deleted as wrong: its ETag goes too
                _etag_file(partial).unlink(missing_ok=True)


def _fetch(client: httpx.Client, remote: RemoteFile, partial: Path, headers: dict[str, str],
           progress: Progress | None, task: TaskID | None, max_bytes: int) -> None:
    etag_file = _etag_file(partial)
    have = partial.stat().st_size if partial.exists() else 0
    request_headers = dict(headers)
    if have and remote.size is not None and have >= remote.size:
        return  # complete already; size and digest are checked next
    if have:
        request_headers["Range"] = f"bytes={have}-"
        if etag_file.exists():
            request_headers["If-Range"] = etag_file.read_text()
    with client.stream("GET", remote.url, headers=request_headers) as response:
        if response.status_code == 416 and have:
            partial.unlink()  # what we hold is not a prefix of the file; start over
            raise _Retry(f"the server refused to resume at byte {have}")
        if response.status_code == 206:
            if not response.headers.get("content-range", "").startswith(f"bytes {have}-"):
                partial.unlink()
                raise _Retry("the server resumed at another offset than asked")
            mode = "ab"
        elif response.status_code == 200:
            have, mode = 0, "wb"  # no resume (no partial, or the file changed): from the start
        else:
            raise DownloadError(f"{remote.name}: {_http_error(response)}")
        length = response.headers.get("content-length", "")
        if length.isdigit() and have + int(length) > max_bytes:
            raise DownloadError(f"{remote.name}: the server offers {have + int(length):,} bytes, more than the "
                                f"limit of {max_bytes:,} (pull --max-size)")
        if etag := response.headers.get("etag"):
            etag_file.write_text(etag)
        if progress is not None and task is not None:
            progress.update(task, completed=have)
        with open(partial, mode) as writer:
            for chunk in response.iter_bytes():  # as it arrives: a dropped connection loses nothing read
                have += len(chunk)
                if have > max_bytes:  # no Content-Length, and no end in sight
                    writer.close()
                    partial.unlink()
                    raise DownloadError(f"{remote.name}: the server sent more than the limit of {max_bytes:,} bytes "
                                        "(pull --max-size); what arrived was deleted")
                writer.write(chunk)
                if progress is not None and task is not None:
                    progress.advance(task, len(chunk))


class _Retry(DownloadError):
    """Worth another attempt at once."""


def _etag_file(partial: Path) -> Path:
    # The server's ETag for the partial bytes: resuming sends it as If-Range.
    return partial.with_name(partial.name + ".etag")


def _http_error(response: httpx.Response) -> str:
    status = response.status_code
    if status in (401, 403):
        return (f"HTTP {status}: access denied (a gated or private repo needs a token: set HF_TOKEN or run "
                "`hf auth login`)")
    if status == 404:
        return "HTTP 404: not found"
    return f"HTTP {status} from {response.url.host}"


def _check_size(partial: Path, remote: RemoteFile) -> None:
    size = partial.stat().st_size if partial.exists() else 0
    if remote.size is not None and size != remote.size:
        partial.unlink(missing_ok=True)
        raise DownloadError(f"{remote.name}: got {size} bytes, expected {remote.size}; the partial file was "
                            "deleted, pull again")


def _check_git_sha1(partial: Path, remote: RemoteFile) -> None:
    # Git names a blob by sha1("blob <size>\0" + content): the Hub's id of a small file.
    sha = hashlib.sha1(f"blob {partial.stat().st_size}\0".encode())
    with open(partial, "rb") as reader:
        while chunk := reader.read(_CHUNK):
            sha.update(chunk)
    if sha.hexdigest() != remote.git_sha1:
        partial.unlink()
        raise DownloadError(f"{remote.name}: content does not match the repo's blob id {remote.git_sha1}; the file "
                            "is corrupt (nothing was registered)")


@contextmanager
def _exclusive(partial: Path) -> Iterator[None]:
    """One writer per partial file: a second pull of the same file stops instead of
    interleaving its bytes."""
    lock_path = partial.with_name(partial.name + ".lock")
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DownloadError(f"{partial.name}: another pull is downloading this file now") from None
        try:
            yield
        finally:
            lock_path.unlink(missing_ok=True)
