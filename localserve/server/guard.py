"""The checks every HTTP request passes before the app sees it.

In order: the Host header (a server bound to loopback answers only to loopback
names, which defeats DNS rebinding: a web page cannot reach it through a name it
controls), draining (503 once SIGTERM arrived), the API key (``Authorization: Bearer
KEY`` as OpenAI's clients send it or ``x-api-key: KEY`` as Anthropic's do; constant-time
compare; /health needs none), and the body (JSON only, bounded in size). A plain ASGI
middleware, so it costs one function call per request. Refusals come in the error shape
of the API asked (Anthropic's on its routes).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from .anthropic_protocol import error_body, is_messages_path
from .errors import error_bytes

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
UNGUARDED_PATHS = ("/health",)  # reachable without a key, and while draining
DRAIN_EXEMPT_PATHS = ("/health", "/metrics")


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header, without the port (``[::1]:8000`` -> ``::1``)."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass
class GuardState:
    api_key: str | None
    loopback_only: bool  # bound to a loopback address: check Host
    max_body_bytes: int
    draining: bool = False
    in_flight: int = 0  # HTTP requests being answered


class Guard:
    def __init__(self, app: ASGIApp, state: GuardState) -> None:
        self.app = app
        self.state = state
        self._key = state.api_key.encode() if state.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            status, message, kind, extra = refusal
            await _respond(send, status, _error(scope["path"], status, message, kind), extra)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(receive, headers)
            if isinstance(body, tuple):
                status, message = body
                await _respond(send, status, _error(scope["path"], status, message, "invalid_request_error"), [])
                return
            receive = _replay(body, receive)
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> tuple[int, str, str, list] | None:
        path = scope["path"]
        if self.state.loopback_only and not is_loopback(host_name(headers.get("host", ""))):
            return 403, "this server answers only to localhost (Host header refused)", "permission_error", []
        if self.state.draining and path not in DRAIN_EXEMPT_PATHS:
            return 503, "the server is shutting down", "service_unavailable", [(b"retry-after", b"5")]
        if self._key is not None and path not in UNGUARDED_PATHS and not self._authorized(headers):
            return 401, "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)", \
                "authentication_error", [(b"www-authenticate", b"Bearer")]
        return None

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        bearer = token.strip().encode() if scheme.lower() == "bearer" else b""
        api_key = headers.get("x-api-key", "").strip().encode()
        # Both compared, whichever is given, so the time taken tells nothing.
        matches = [hmac.compare_digest(given, self._key or b"") for given in (bearer, api_key)]
        return any(matches)

    async def _read_body(self, receive: Receive, headers: dict[str, str]) -> bytes | tuple[int, str]:
        content_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json" and not content_type.endswith("+json"):
            return 415, f"the body must be JSON (Content-Type: application/json), not {content_type or 'untyped'!r}"
        limit = self.state.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return 413, f"the body is larger than {limit} bytes"
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return 400, "the client went away"
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return 413, f"the body is larger than {limit} bytes"
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _error(path: str, status: int, message: str, kind: str) -> bytes:
    if is_messages_path(path):
        return json.dumps(error_body(status, message)).encode()
    return error_bytes(status, message, kind)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the body already read, then the client's events
    (so the app still learns when the client disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _respond(send: Send, status: int, body: bytes, extra_headers: list) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
