"""Every error the server returns, in OpenAI's JSON shape (Ollama's and Anthropic's on
their routes).

``{"error": {"message", "type", "param", "code"}}``: bad input is a 400 (404 for an
unknown model), a full queue a 429 and a model that cannot serve yet a 503, both with
Retry-After. Only a bug is a 500, and its message says so without leaking internals,
with the request id its traceback is logged under (also in ``x-request-id``).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..engine.async_engine import EngineDeadError, QueueFullError
from ..errors import LocalserveError
from .anthropic_protocol import error_body as anthropic_error_body, is_messages_path
from .catalog import ModelNotFoundError
from .model_manager import ModelUnavailableError

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"  # on a 500: the id its traceback is logged under


def error_response(status: int, message: str, type: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def error_bytes(status: int, message: str, type: str) -> bytes:
    """The same body, for responses written below FastAPI (the guard middleware)."""
    return error_response(status, message, type).body


def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0]
    location = _param_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                              "invalid_request_error")
    message = first.get("msg", "invalid request")
    if location:
        message = f"{'.'.join(location)}: {message}"
    return error_response(400, message, "invalid_request_error", ".".join(location) or None)


def _param_path(loc: tuple) -> list[str]:
    """The field path a client sent (``messages.0.content``), without FastAPI's "body"
    and what pydantic appends for union members and dict keys."""
    path = []
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if not (isinstance(part, int) or str(part).isidentifier()):
            break
        path.append(str(part))
    return path


def _localserve_error(_: Request, exc: Exception) -> JSONResponse:
    message = str(exc)
    if isinstance(exc, ModelNotFoundError):
        return error_response(404, message, "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, QueueFullError):
        return error_response(429, message, "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, ModelUnavailableError):
        return error_response(503, message, "service_unavailable", code="model_unavailable",
                              headers={"Retry-After": str(exc.retry_after)})
    return error_response(400, message, "invalid_request_error")


def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, str(exc.detail), "invalid_request_error", headers=exc.headers)


def _engine_error(request: Request, exc: Exception) -> JSONResponse:
    _note_error(request, str(exc))
    return error_response(500, str(exc), "server_error")


def _bug(request: Request, exc: Exception) -> JSONResponse:
    """A 500 that tells nothing of the internals, but gives the id under which the server
    logged the traceback, so an operator can find it from what a client reports."""
    request_id = uuid.uuid4().hex[:12]
    what = f"{type(exc).__name__} serving {request.method} {request.url.path} (request id {request_id})"
    log.exception("unhandled %s", what, exc_info=exc)
    _note_error(request, what)
    return error_response(500, f"internal server error (a bug: see the server log for request id {request_id})",
                          "server_error", headers={REQUEST_ID_HEADER: request_id})


def _note_error(request: Request, message: str) -> None:
    """A 500 goes to the event log too, where the dashboard shows it."""
    request.app.state.localserve.events.add("error", None, message[:300])


def _ollama_route(path: str) -> bool:
    return path.startswith("/api/") and not path.startswith("/api/localserve/")


def _ollama_error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": message}


def _in_the_routes_shape(handler: Callable[[Request, Exception], JSONResponse]) -> Callable[[Request, Exception], JSONResponse]:
    """Errors of Ollama's routes in Ollama's shape, ``{"error": message}``, of Anthropic's
    in Anthropic's, ``{"type": "error", "error": {"type", "message"}}``, with the same status,
    Retry-After and x-request-id; every other route's in OpenAI's."""

    def handle(request: Request, exc: Exception) -> JSONResponse:
        response = handler(request, exc)
        path = request.url.path
        if is_messages_path(path):
            shape = anthropic_error_body
        elif _ollama_route(path):
            shape = _ollama_error_body
        else:
            return response
        message = json.loads(bytes(response.body))["error"]["message"]
        kept = {k: v for k, v in response.headers.items() if k.lower() in ("retry-after", REQUEST_ID_HEADER)}
        return JSONResponse(shape(response.status_code, message), status_code=response.status_code, headers=kept)

    return handle


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _in_the_routes_shape(_validation_error))
    app.add_exception_handler(LocalserveError, _in_the_routes_shape(_localserve_error))
    app.add_exception_handler(HTTPException, _in_the_routes_shape(_http_error))
    app.add_exception_handler(EngineDeadError, _in_the_routes_shape(_engine_error))
    app.add_exception_handler(Exception, _in_the_routes_shape(_bug))
