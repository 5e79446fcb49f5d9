"""schemathesis generates requests from the app's own OpenAPI schema; none may get a 5xx."""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from localserve.server.app import create_app
from localserve.server.config import ServerConfig

from .server_util import running_server, small_engine_config, stories_with_template

# The schema does not depend on the models served.
schema = schemathesis.openapi.from_dict(create_app(ServerConfig()).openapi())

# Generated bodies keep their fields but ask for little work, so the run stays short:
# random token budgets over a 512-token context and 16 choices of 256 prompts would
# take minutes without finding anything new.
_SMALL = {"max_tokens": 4, "max_completion_tokens": 4, "min_tokens": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    path: Path = stories_with_template(tmp_path_factory.mktemp("models"))
    config = ServerConfig(models={"stories": path}, preload=["stories"], engine=small_engine_config(), device="cpu")
    with running_server(config) as running:
        yield running


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case, server) -> None:  # type: ignore[no-untyped-def]
    if isinstance(case.body, dict):
        if "model" in case.body and case.operation.path != "/api/localserve/unload":
            case.body["model"] = "stories"  # unknown names are one 404; the sampling fields are the surface
        case.body.update({key: value for key, value in _SMALL.items() if key in case.body or key == "max_tokens"})
        if isinstance(case.body.get("prompt"), list):
            case.body["prompt"] = case.body["prompt"][:4]
        case.body.pop("keep_alive", None)
        messages = case.body.get("messages")
        for message in messages if isinstance(messages, list) else []:
            if isinstance(message, dict) and message.get("content") is None:
                message["content"] = "Hi"  # optional in the schema only for assistant tool calls
    response = case.call(base_url=server.url, timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {response.text[:500]}"
