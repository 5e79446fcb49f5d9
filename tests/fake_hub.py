"""A fake Hugging Face Hub on loopback, for tests that download models with no network.

It serves the model-repo endpoints huggingface_hub (2.x) calls: model info, the tree listing,
and HEAD/GET on /resolve, with the headers hf_hub_download relies on. It never sends X-Xet-*
headers or xetHash fields, so the client falls back to plain HTTP downloads (with Range resume).
Point `HfApi(endpoint=hub.endpoint)` / `endpoint=` at it. HF_ENDPOINT only works if it is set
before huggingface_hub is imported (the library reads it into constants at import time); after
that, patch `huggingface_hub.constants.ENDPOINT` and `.HUGGINGFACE_CO_URL_TEMPLATE` instead.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import traceback
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote

# The Hub's default .gitattributes sends these to LFS; uploads over 10 MiB go to LFS as well.
LFS_SUFFIXES = (
    ".gguf", ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".onnx", ".msgpack", ".model",
    ".pkl", ".pickle", ".npy", ".npz", ".parquet", ".arrow", ".zip", ".tar", ".gz", ".zst",
)
LFS_MIN_SIZE = 10 * 1024 * 1024
TIMESTAMP = "2024-01-01T00:00:00.000Z"
CHUNK = 64 * 1024


def git_blob_sha1(data: bytes) -> str:
    """The object id git gives a blob: what the Hub reports as `oid` / `blobId`."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class LoggedRequest:
    method: str
    path: str  # URL path without the query string, unquoted
    headers: dict[str, str]  # lower-cased names


@dataclass
class _File:
    data: bytes
    lfs: bool

    def __post_init__(self) -> None:
        # Computed once: metadata requests are frequent and files can be large.
        self.sha256 = hashlib.sha256(self.data).hexdigest()
        # An LFS file's git blob is its pointer, so its oid is the pointer's sha1, not the data's.
        self.pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.data)}\n"
        self.oid = git_blob_sha1(self.pointer.encode() if self.lfs else self.data)

    def lfs_json(self, oid_key: str) -> dict[str, Any]:
        # model_info calls the hash "sha256", the tree listing calls it "oid".
        return {oid_key: self.sha256, "size": len(self.data), "pointerSize": len(self.pointer)}


@dataclass
class _Repo:
    sha: str
    files: dict[str, _File] = field(default_factory=dict)
    card_data: dict[str, Any] | None = None
    corrupted: set[str] = field(default_factory=set)


@dataclass
class _Response:
    status: int
    headers: dict[str, str]
    body: bytes = b""


class FakeHub:
    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.endpoint = ""
        self.requests: list[LoggedRequest] = []
        self._repos: dict[str, _Repo] = {}
        self._plain_files: dict[str, bytes] = {}
        self._interrupts: list[tuple[str, int]] = []
        self._sent: dict[str, int] = {}  # path -> GET body bytes written
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- content -----------------------------------------------------------------------------

    def _repo(self, repo: str) -> _Repo:
        if repo.count("/") != 1 or not all(repo.split("/")):
            raise ValueError(f"repo must be 'owner/name', got {repo!r}")
        if repo not in self._repos:
            self._repos[repo] = _Repo(sha=self.sha(repo))
        return self._repos[repo]

    def add_file(self, repo: str, path: str, data: bytes, lfs: bool | None = None) -> None:
        if lfs is None:
            lfs = path.lower().endswith(LFS_SUFFIXES) or len(data) > LFS_MIN_SIZE
        with self._lock:
            self._repo(repo).files[path.strip("/")] = _File(data, lfs)

    def set_card_data(self, repo: str, card_data: dict) -> None:
        with self._lock:
            self._repo(repo).card_data = dict(card_data)

    @staticmethod
    def sha(repo: str) -> str:
        """The repo's commit hash, accepted as a revision besides "main".

        Fixed per repo name (not per content), so tests can pin it; 40 hex digits, so huggingface_hub
        treats it as a commit and skips resolving it.
        """
        return hashlib.sha1(f"fakehub:{repo}".encode()).hexdigest()

    def serve_file(self, url_path: str, data: bytes) -> str:
        if not self.endpoint:
            raise RuntimeError("start the hub before serve_file: the URL names its port")
        url_path = url_path.strip("/")
        with self._lock:
            self._plain_files[url_path] = data
        return f"{self.endpoint}/files/{url_path}"

    def interrupt_after(self, url_path_suffix: str, nbytes: int) -> None:
        with self._lock:
            self._interrupts.append((url_path_suffix, nbytes))

    def corrupt(self, repo: str, path: str) -> None:
        with self._lock:
            self._repo(repo).corrupted.add(path.strip("/"))

    def downloaded_bytes(self, url_path_suffix: str) -> int:
        with self._lock:
            return sum(n for path, n in self._sent.items() if path.endswith(url_path_suffix))

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> FakeHub:
        handler = type("_BoundHandler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True  # keep-alive connections must not block stop()
        self._server.handle_error = lambda request, client_address: None  # type: ignore[method-assign]
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        # A short poll interval: stop() waits up to one interval, and tests stop a hub each.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="fake-hub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
            # Clients pool keep-alive connections; cut them so a stopped hub really is unreachable.
            with self._lock:
                connections, self._connections = list(self._connections), set()
            for conn in connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- request handling (called from handler threads) --------------------------------------

    def _log(self, method: str, path: str, headers: dict[str, str]) -> None:
        with self._lock:
            self.requests.append(LoggedRequest(method, path, headers))

    def _take_interrupt(self, path: str) -> int | None:
        with self._lock:
            for i, (suffix, nbytes) in enumerate(self._interrupts):
                if path.endswith(suffix):
                    del self._interrupts[i]
                    return nbytes
        return None

    def _count_sent(self, path: str, n: int) -> None:
        with self._lock:
            self._sent[path] = self._sent.get(path, 0) + n

    def _auth_error(self, authorization: str | None) -> _Response | None:
        if self.token is None or authorization == f"Bearer {self.token}":
            return None
        # The Hub's two 401 messages: no credentials, and credentials it does not accept.
        if authorization is None:
            return _error(401, None, "Invalid username or password.")
        return _error(401, None, "Invalid credentials in Authorization header")

    def _route(self, method: str, raw_path: str, query: dict[str, list[str]], range_header: str | None) -> _Response:
        # Split before unquoting: revisions and tree subpaths arrive percent-encoded with "/" as %2F.
        seg = raw_path.split("/")[1:]
        if method not in ("GET", "HEAD"):
            return _error(404, None, "Not Found")
        if seg[:1] == ["files"] and len(seg) > 1:
            with self._lock:
                data = self._plain_files.get(unquote("/".join(seg[1:])))
            if data is None:
                return _error(404, "EntryNotFound", "File not found")
            etag = f'"{hashlib.sha256(data).hexdigest()}"'
            return _body_response(data, data, range_header, {"ETag": etag})
        if seg[:2] == ["api", "models"] and len(seg) >= 4:
            repo_id = f"{unquote(seg[2])}/{unquote(seg[3])}"
            rest = seg[4:]
            if method == "GET" and not rest:
                return self._model_info(repo_id, "main", query)
            if method == "GET" and len(rest) == 2 and rest[0] == "revision":
                return self._model_info(repo_id, unquote(rest[1]), query)
            if method == "GET" and len(rest) >= 2 and rest[0] == "tree":
                subpath = "/".join(unquote(s) for s in rest[2:]).strip("/")
                return self._tree(repo_id, unquote(rest[1]), subpath, query)
        if len(seg) >= 5 and seg[2] == "resolve":
            repo_id = f"{unquote(seg[0])}/{unquote(seg[1])}"
            return self._resolve(repo_id, unquote(seg[3]), unquote("/".join(seg[4:])), range_header)
        return _error(404, None, "Not Found")

    def _lookup(self, repo_id: str, revision: str) -> _Repo | _Response:
        repo = self._repos.get(repo_id)
        if repo is None:
            return _error(404, "RepoNotFound", "Repository not found")
        if revision not in ("main", repo.sha):
            return _error(404, "RevisionNotFound", "Invalid rev id: " + revision)
        return repo

    def _model_info(self, repo_id: str, revision: str, query: dict[str, list[str]]) -> _Response:
        with self._lock:
            repo = self._lookup(repo_id, revision)
            if isinstance(repo, _Response):
                return repo
            blobs = _flag(query, "blobs")  # what model_info(files_metadata=True) sends
            siblings = []
            for path, f in sorted(repo.files.items()):
                sibling: dict[str, Any] = {"rfilename": path}
                if blobs:
                    sibling.update(size=len(f.data), blobId=f.oid)
                    if f.lfs:
                        sibling["lfs"] = f.lfs_json("sha256")
                siblings.append(sibling)
            # The Hub derives tags from the files and the card; enough of that to look real.
            suffixes = {p.rsplit(".", 1)[-1] for p in repo.files}
            tags = [t for t in ("gguf", "safetensors") if t in suffixes]
            info: dict[str, Any] = {
                "_id": repo.sha[:24], "id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0],
                "sha": repo.sha, "private": False, "gated": False, "disabled": False, "downloads": 0, "likes": 0,
                "tags": tags, "lastModified": TIMESTAMP, "createdAt": TIMESTAMP, "siblings": siblings,
            }
            if repo.card_data is not None:
                info["cardData"] = repo.card_data
                if "license" in repo.card_data:
                    tags.append(f"license:{repo.card_data['license']}")
        return _json(200, info)

    def _tree(self, repo_id: str, revision: str, subpath: str, query: dict[str, list[str]]) -> _Response:
        with self._lock:
            repo = self._lookup(repo_id, revision)
            if isinstance(repo, _Response):
                return repo
            prefix = f"{subpath}/" if subpath else ""
            files = {p: f for p, f in repo.files.items() if p.startswith(prefix)}
            if subpath and not files:
                return _error(404, "EntryNotFound", f"{subpath} does not exist on \"{revision}\"")
            recursive, expand = _flag(query, "recursive"), _flag(query, "expand")
            entries: dict[str, dict[str, Any]] = {}
            for path, f in files.items():
                parts = path[len(prefix):].split("/")
                # Folders on the way down: all of them when recursive, only the first level otherwise.
                for depth in range(1, len(parts) if recursive else min(len(parts), 2)):
                    folder = prefix + "/".join(parts[:depth])
                    # Stable, but not the real git tree id (nothing in the client checks it).
                    oid = hashlib.sha1(f"tree:{repo.sha}:{folder}".encode()).hexdigest()
                    entries[folder] = {"type": "directory", "oid": oid, "size": 0, "path": folder}
                if recursive or len(parts) == 1:
                    entry: dict[str, Any] = {"type": "file", "oid": f.oid, "size": len(f.data), "path": path}
                    if f.lfs:
                        entry["lfs"] = f.lfs_json("oid")
                    entries[path] = entry
            if expand:
                for entry in entries.values():
                    entry["lastCommit"] = {"id": repo.sha, "title": "Upload files", "date": TIMESTAMP}
        # One page with no Link header: huggingface_hub only follows a Link rel="next".
        return _json(200, [entries[p] for p in sorted(entries)])

    def _resolve(self, repo_id: str, revision: str, path: str, range_header: str | None) -> _Response:
        with self._lock:
            repo = self._lookup(repo_id, revision)
            if isinstance(repo, _Response):
                return repo
            f = repo.files.get(path)
            if f is None:
                # The Hub names the commit even on a miss; hf_hub_download caches the miss under it.
                return _error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": repo.sha})
            served = _flip_one_byte(f.data) if path in repo.corrupted else f.data
            # hf_hub_download requires X-Repo-Commit and an ETag; it prefers X-Linked-Etag/Size (LFS) to them.
            headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{f.sha256 if f.lfs else f.oid}"'}
            if f.lfs:
                headers.update({"X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(len(f.data))})
        return _body_response(f.data, served, range_header, headers)


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"  # keep-alive, as huggingface_hub's pooled client expects
    timeout = 30  # idle keep-alive connections of stopped hubs eventually free their threads

    def setup(self) -> None:
        super().setup()
        with self.hub._lock:
            self.hub._connections.add(self.connection)

    def finish(self) -> None:
        with self.hub._lock:
            self.hub._connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def _handle(self) -> None:
        raw_path, _, query = self.path.partition("?")
        path = unquote(raw_path)
        self.hub._log(self.command, path, {k.lower(): v for k, v in self.headers.items()})
        if self.command not in ("GET", "HEAD"):
            self.close_connection = True  # we do not read request bodies, so this connection cannot be reused
        try:
            response = self.hub._auth_error(self.headers.get("Authorization")) or self.hub._route(
                self.command, raw_path, parse_qs(query), self.headers.get("Range")
            )
        except Exception:  # a bug in the fake: say so in the response instead of a silent reset
            response = _Response(500, {"Content-Type": "text/plain"}, traceback.format_exc().encode())
        limit = None
        if self.command == "GET" and 200 <= response.status < 300:
            limit = self.hub._take_interrupt(path)
        self.send_response(response.status)
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(response.body)))  # the full length, even when interrupted
        self.end_headers()
        if self.command == "HEAD":
            return
        body = response.body if limit is None else response.body[:limit]
        try:
            for start in range(0, len(body), CHUNK):
                chunk = body[start : start + CHUNK]
                # Counted before the write: once the client has the bytes, a test may read the count.
                self.hub._count_sent(path, len(chunk))
                self.wfile.write(chunk)
            self.wfile.flush()
        except OSError:  # the client went away mid-body
            self.close_connection = True
        if limit is not None:
            self.close_connection = True  # the promised Content-Length is never met: the client sees a cut

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _handle


def _flag(query: dict[str, list[str]], name: str) -> bool:
    return query.get(name, ["false"])[-1].lower() in ("1", "true")


def _flip_one_byte(data: bytes) -> bytes:
    if not data:
        return data
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]


def _json(status: int, payload: Any, headers: dict[str, str] | None = None) -> _Response:
    return _Response(status, {"Content-Type": "application/json; charset=utf-8", **(headers or {})},
                     json.dumps(payload).encode())


def _error(status: int, code: str | None, message: str, headers: dict[str, str] | None = None) -> _Response:
    # huggingface_hub picks its exception class from X-Error-Code (and some 401s from X-Error-Message).
    extra = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {}), **(headers or {})}
    return _json(status, {"error": message}, extra)


_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def _body_response(data: bytes, served: bytes, range_header: str | None, headers: dict[str, str]) -> _Response:
    """200 or 206/416 for a Range; `data` is the true content (sizes), `served` what goes out."""
    headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes", **headers}
    size = len(data)
    match = _RANGE.fullmatch(range_header.strip()) if range_header else None
    if match is None or match.groups() == ("", ""):
        return _Response(200, headers, served)  # no Range, or one we do not parse: the whole file, as RFC 9110 allows
    first, last = match.groups()
    if first == "":  # "bytes=-N": the last N bytes
        start, end = max(size - int(last), 0), size - 1
    else:
        start, end = int(first), min(int(last), size - 1) if last else size - 1
    if start >= size or (first == "" and int(last) == 0):
        return _Response(416, {**headers, "Content-Range": f"bytes */{size}"})
    if end < start:
        return _Response(200, headers, served)  # "bytes=5-2" is invalid syntax: ignore it
    return _Response(206, {**headers, "Content-Range": f"bytes {start}-{end}/{size}"}, served[start : end + 1])
