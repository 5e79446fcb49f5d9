"""The CLI's side of the daemon: find it, ask it, stream from it.

Where the daemon is: ``LOCALSERVE_URL`` (e.g. ``http://10.0.0.5:8000``), else
``LOCALSERVE_HOST``/``LOCALSERVE_PORT`` as ``localserve serve`` reads them, else
``http://127.0.0.1:8000``. ``LOCALSERVE_API_KEY`` is sent when set.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx

from .errors import LocalserveError

_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class DaemonError(LocalserveError):
    """The daemon answered with an error."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def daemon_url() -> str:
    if url := os.environ.get("LOCALSERVE_URL"):
        return url.rstrip("/")
    host = os.environ.get("LOCALSERVE_HOST", "127.0.0.1")
    host = _WILDCARDS.get(host, host)  # a daemon listening everywhere is reached on loopback
    port = os.environ.get("LOCALSERVE_PORT", "8000")
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Thinking(str):
    """A piece of a model's reasoning (its ``<think>`` block), apart from the answer."""


class Stopped(str):
    """The last, empty piece of a reply cut short by its length limit (the request's
    max_tokens, else the model's num_predict, else the context's end), so that the
    caller can say why it ended there."""

    reason: str

    def __new__(cls, reason: str) -> Stopped:
        piece = super().__new__(cls, "")
        piece.reason = reason
        return piece


class DaemonClient:
    def __init__(self, url: str | None = None, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.url = url or daemon_url()
        key = api_key if api_key is not None else os.environ.get("LOCALSERVE_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, connect=2.0))

    def reachable(self) -> bool:
        """Whether a daemon answers at the URL (quickly: this decides where `run` runs)."""
        try:
            return self.http.get("/health", timeout=1.0).status_code in (200, 503)
        except httpx.HTTPError:
            return False

    def get(self, path: str) -> Any:
        return self._send("GET", path).json()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self._send("POST", path, json=body).json()

    def stream_text(self, path: str, body: dict[str, Any]) -> Iterator[str]:
        """POST a streaming completion and yield each chunk's new text (a thinking model's
        reasoning as ``Thinking`` pieces; ``Stopped`` last if the length limit ended it);
        closing the iterator closes the connection, which cancels the request on the daemon."""
        try:
            with self.http.stream("POST", path, json={**body, "stream": True}) as response:
                if response.status_code != 200:
                    response.read()
                    raise _error(response)
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        raise DaemonError(str(event["error"].get("message", event["error"])), 500)
                    for choice in event.get("choices", []):
                        delta = choice.get("delta", {})
                        if delta.get("reasoning_content"):
                            yield Thinking(delta["reasoning_content"])
                        text = delta.get("content") if "delta" in choice else choice.get("text")
                        if text:
                            yield text
                        if choice.get("finish_reason") == "length":
                            yield Stopped("length")
        except httpx.HTTPError as exc:
            raise LocalserveError(f"lost the daemon at {self.url} ({exc})") from exc

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise LocalserveError(f"cannot reach the daemon at {self.url} ({exc}); is `localserve serve` "
                                  "running? (LOCALSERVE_URL says where)") from exc
        if response.status_code >= 400:
            raise _error(response)
        return response


def _error(response: httpx.Response) -> DaemonError:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:300] or response.reason_phrase
    return DaemonError(f"the daemon answered {response.status_code}: {message}", response.status_code)
