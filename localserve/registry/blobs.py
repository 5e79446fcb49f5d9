"""The content-addressed blob store: ``blobs/sha256-<hex>``.

A blob is written under a temporary name, hashed while it is written, and renamed
into place only when its digest is known (and equals the expected one, when there
is one), so a blob under its final name is always complete and correct.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import LocalserveError

DIGEST = re.compile(r"sha256-[0-9a-f]{64}")
_CHUNK = 1 << 20


def check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        raise LocalserveError(f"{str(digest)[:80]!r} is not a digest of the form sha256-<64 hex digits>")
    return digest


def expected_digest(sha256: str) -> str:
    """A user's ``--sha256`` (hex, or sha256-hex) as the store names blobs."""
    return check_digest(sha256 if sha256.startswith("sha256-") else f"sha256-{sha256.lower()}")


def file_digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(_CHUNK):
            sha.update(chunk)
    return f"sha256-{sha.hexdigest()}"


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._remove_orphans()

    def _remove_orphans(self) -> None:
        """Delete the temporary copies of imports that were killed (resumable download
        partials stay). A copy in progress holds a lock on its file, so only orphans go."""
        for temporary in self.root.glob("tmp-*"):
            try:
                with open(temporary, "rb") as handle:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    temporary.unlink()
            except (BlockingIOError, FileNotFoundError):
                continue  # being written, or gone already

    def path(self, digest: str) -> Path:
        return self.root / check_digest(digest)

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def partial_path(self, key: str) -> Path:
        """Where an interrupted download of ``key`` (a digest or a URL's hash) is kept."""
        if not re.fullmatch(r"[0-9a-z-]{1,80}", key):
            raise LocalserveError(f"invalid partial-download key {key[:80]!r}")
        return self.root / f"partial-{key}"

    def add_file(self, source: Path, expected: str | None = None) -> str:
        """Copy ``source`` into the store; returns its digest."""
        temporary = self.root / f"tmp-{uuid.uuid4().hex}"
        sha = hashlib.sha256()
        try:
            with self._storing(str(source)), open(source, "rb") as reader, open(temporary, "wb") as writer:
                fcntl.flock(writer, fcntl.LOCK_EX)  # not an orphan while this runs (see _remove_orphans)
                while chunk := reader.read(_CHUNK):
                    sha.update(chunk)
                    writer.write(chunk)
                writer.flush()
                # Renamed while still locked, so no cleanup can take it between.
                return self._commit(temporary, f"sha256-{sha.hexdigest()}", expected, str(source))
        finally:
            temporary.unlink(missing_ok=True)

    def add_bytes(self, data: bytes) -> str:
        """Store ``data`` (a model's settings, a license text); returns its digest."""
        temporary = self.root / f"tmp-{uuid.uuid4().hex}"
        try:
            with self._storing("data"), open(temporary, "wb") as writer:
                fcntl.flock(writer, fcntl.LOCK_EX)
                writer.write(data)
                writer.flush()
                return self._commit(temporary, f"sha256-{hashlib.sha256(data).hexdigest()}", None, "data")
        finally:
            temporary.unlink(missing_ok=True)

    @contextmanager
    def _storing(self, what: str) -> Iterator[None]:
        """A copy the disk refuses (full, read-only) as one line that names the store: a
        failed write's OSError names no file."""
        try:
            yield
        except OSError as exc:
            raise LocalserveError(f"cannot store {what} in {self.root} ({exc.strerror or exc})") from exc

    def commit_partial(self, partial: Path, expected: str | None = None, what: str = "download") -> str:
        """Hash a finished download and move it into place; a mismatch deletes it."""
        try:
            return self._commit(partial, file_digest(partial), expected, what)
        finally:
            partial.unlink(missing_ok=True)

    def _commit(self, temporary: Path, digest: str, expected: str | None, what: str) -> str:
        if expected is not None and digest != check_digest(expected):
            raise LocalserveError(f"{what}: content digest {digest} does not match the expected {expected}; "
                                  "the file is corrupt or was changed (nothing was registered)")
        final = self.path(digest)
        if not final.exists():
            os.replace(temporary, final)
        return digest

    def verify(self, digest: str) -> bool:
        """Whether the blob is there and its content still has its name's digest."""
        path = self.path(digest)
        return path.is_file() and file_digest(path) == digest

    def remove(self, digests: Iterable[str]) -> None:
        for digest in digests:
            self.path(digest).unlink(missing_ok=True)
