"""Bad input gets the right 4xx in OpenAI's error shape, and the server keeps serving;
the API key, the Host check and the refusal to serve a public address without a key."""

from __future__ import annotations

import logging

import httpx
import pytest
from click.testing import CliRunner

from localserve.cli.main import main
from localserve.errors import LocalserveError
from localserve.server.config import ServerConfig
from localserve.server.serve import check_bind

from .server_util import running_server, small_engine_config, stories_with_template

CHAT = {"model": "stories", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 4}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return stories_with_template(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def server(model_path):  # type: ignore[no-untyped-def]
    config = ServerConfig(models={"stories": model_path}, preload=["stories"], engine=small_engine_config(),
                          device="cpu", max_body_bytes=1 << 20)
    with running_server(config) as running:
        yield running


def with_fields(base: dict, **changes: object) -> dict:
    body = {**base, **changes}
    return {key: value for key, value in body.items() if value is not _DROP}


_DROP = object()

BAD_REQUESTS = [
    # wrong types
    ("chat", with_fields(CHAT, temperature="hot"), 400, "temperature"),
    ("chat", with_fields(CHAT, max_tokens="10"), 400, "max_tokens"),
    ("chat", with_fields(CHAT, n=1.5), 400, "n"),
    ("chat", with_fields(CHAT, stream="yes"), 400, "stream"),
    ("chat", with_fields(CHAT, messages="hello"), 400, "messages"),
    ("chat", with_fields(CHAT, stop=5), 400, "stop"),
    ("chat", with_fields(CHAT, logprobs="yes"), 400, "logprobs"),
    ("chat", with_fields(CHAT, seed="1"), 400, "seed"),
    ("chat", with_fields(CHAT, logit_bias={"abc": 1}), 400, "logit_bias"),
    ("chat", with_fields(CHAT, logit_bias={"5": "up"}), 400, "logit_bias"),
    ("chat", with_fields(CHAT, model=7), 400, "model"),
    ("completion", with_fields(COMPLETION, prompt=5), 400, "prompt"),
    ("completion", with_fields(COMPLETION, prompt=[1, "a"]), 400, "prompt"),
    ("completion", with_fields(COMPLETION, echo="no"), 400, "echo"),
    # out of range
    ("chat", with_fields(CHAT, temperature=-1), 400, "temperature"),
    ("chat", with_fields(CHAT, temperature=2.5), 400, "temperature"),
    ("chat", with_fields(CHAT, top_p=0), 400, "top_p"),
    ("chat", with_fields(CHAT, top_p=1.5), 400, "top_p"),
    ("chat", with_fields(CHAT, n=0), 400, "n"),
    ("chat", with_fields(CHAT, n=100), 400, "n"),
    ("chat", with_fields(CHAT, max_tokens=0), 400, "max_tokens"),
    ("chat", with_fields(CHAT, max_completion_tokens=-3), 400, "max_completion_tokens"),
    ("chat", with_fields(CHAT, presence_penalty=3), 400, "presence_penalty"),
    ("chat", with_fields(CHAT, frequency_penalty=-2.5), 400, "frequency_penalty"),
    ("chat", with_fields(CHAT, logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("chat", with_fields(CHAT, top_logprobs=2), 400, None),  # without logprobs
    ("chat", with_fields(CHAT, logit_bias={"5": 101}), 400, "logit_bias"),
    ("chat", with_fields(CHAT, logit_bias={"99999": 1}), 400, None),  # beyond the vocabulary
    ("chat", with_fields(CHAT, min_p=2), 400, "min_p"),
    ("chat", with_fields(CHAT, top_k=-2), 400, "top_k"),
    ("chat", with_fields(CHAT, repetition_penalty=0), 400, "repetition_penalty"),
    ("chat", with_fields(CHAT, min_tokens=10), 400, None),  # more than max_tokens
    ("chat", with_fields(CHAT, seed=1 << 70), 400, "seed"),
    ("chat", with_fields(CHAT, stream_options={"include_usage": True}), 400, None),  # without stream
    ("chat", with_fields(CHAT, keep_alive="soon"), 400, "keep_alive"),
    ("chat", with_fields(CHAT, keep_alive=1e18), 400, "keep_alive"),  # once a 500 on /api/ps ever after
    ("chat", with_fields(CHAT, keep_alive="100000h"), 400, "keep_alive"),
    ("chat", with_fields(CHAT, keep_alive="inf"), 400, "keep_alive"),
    ("chat", with_fields(CHAT, max_tokens=10**12), 400, None),  # more than the context
    ("completion", with_fields(COMPLETION, logprobs=21), 400, "logprobs"),
    ("completion", with_fields(COMPLETION, prompt=[5, 99999]), 400, None),  # token beyond the vocabulary
    ("completion", with_fields(COMPLETION, prompt=[]), 400, "prompt"),
    ("completion", with_fields(COMPLETION, suffix="x"), 400, "suffix"),
    # structure
    ("chat", with_fields(CHAT, messages=[]), 400, "messages"),
    ("chat", with_fields(CHAT, messages=[{"role": "wizard", "content": "hi"}]), 400, "messages.0.role"),
    ("chat", with_fields(CHAT, messages=[{"role": "user"}]), 400, "messages.0"),
    ("chat", with_fields(CHAT, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "messages.0.content"),
    ("chat", with_fields(CHAT, model=_DROP), 400, "model"),
    ("completion", with_fields(COMPLETION, prompt=_DROP), 400, "prompt"),
    ("chat", with_fields(CHAT, model="nope"), 404, "model"),
    ("chat", with_fields(CHAT, response_format={"type": "xml"}), 400, "response_format.type"),
    ("chat", with_fields(CHAT, response_format={"type": "json_schema", "json_schema": {"schema": {"type": 5}}}), 400,
     None),  # a schema llguidance cannot compile
]


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize("endpoint, body, status, param", BAD_REQUESTS,
                         ids=[f"{i}-{case[3]}" for i, case in enumerate(BAD_REQUESTS)])
def test_bad_request(server, endpoint: str, body: dict, status: int, param: str | None) -> None:  # type: ignore[no-untyped-def]
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    error = assert_openai_error(httpx.post(server.url + path, json=body), status)
    if param is not None:
        assert error["param"] == param


def test_context_overflow_says_the_numbers(server) -> None:  # type: ignore[no-untyped-def]
    long_prompt = [5] * 600
    error = assert_openai_error(httpx.post(server.url + "/v1/completions",
                                           json={**COMPLETION, "prompt": long_prompt}), 400)
    assert "600" in error["message"] and "512" in error["message"]
    error = assert_openai_error(httpx.post(server.url + "/v1/completions", json={**COMPLETION, "max_tokens": 1000}),
                                400)
    assert "1000" in error["message"] and "512" in error["message"]


def test_malformed_bodies(server) -> None:  # type: ignore[no-untyped-def]
    url = server.url + "/v1/chat/completions"
    error = assert_openai_error(httpx.post(url, content=b'{"model": "stories", ', headers={
        "content-type": "application/json"}), 400)
    assert "JSON" in error["message"]
    assert_openai_error(httpx.post(url, content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
    assert_openai_error(httpx.post(url, content=b'{"model": "stories"}', headers={"content-type": "text/plain"}),
                        415)
    assert_openai_error(httpx.post(url, content=b"{}"), 415)  # no content type at all
    assert_openai_error(httpx.post(url, json={**CHAT, "padding": "x" * (2 << 20)}), 413)
    assert_openai_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(server.url + "/v1/chat/completions"), 405)
    # and the server still serves
    assert httpx.post(url, json=CHAT).status_code == 200


def test_api_key(model_path) -> None:  # type: ignore[no-untyped-def]
    config = ServerConfig(models={"stories": model_path}, engine=small_engine_config(), device="cpu",
                          api_key="s3cret")
    with running_server(config) as server:
        url = server.url
        assert httpx.get(url + "/health").status_code == 200  # no key needed
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}, {"x-api-key": "wrong"}, {"x-api-key": ""},
                        {"x-api-key": "Bearer s3cret"}):
            assert_openai_error(httpx.get(url + "/v1/models", headers=headers), 401)
            assert_openai_error(httpx.get(url + "/metrics", headers=headers), 401)
            assert_openai_error(httpx.post(url + "/v1/completions", json=COMPLETION, headers=headers), 401)
        # Bearer as OpenAI's clients send it, x-api-key as Anthropic's do; either one right is enough
        for good in ({"Authorization": "Bearer s3cret"}, {"x-api-key": "s3cret"},
                     {"x-api-key": "wrong", "Authorization": "Bearer s3cret"}):
            assert httpx.get(url + "/v1/models", headers=good).status_code == 200
            assert httpx.post(url + "/v1/completions", json=COMPLETION, headers=good).status_code == 200


def test_host_header_must_be_loopback(server) -> None:  # type: ignore[no-untyped-def]
    for host in ("evil.example", "evil.example:8000", "192.168.1.5", "localhost.evil.example"):
        error = assert_openai_error(httpx.get(server.url + "/v1/models", headers={"Host": host}), 403)
        assert "Host" in error["message"]
    for host in ("localhost", f"localhost:{server.port}", f"127.0.0.1:{server.port}", "[::1]:80"):
        assert httpx.get(server.url + "/v1/models", headers={"Host": host}).status_code == 200


def test_public_bind_needs_a_key(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(LocalserveError, match="API key"):
        check_bind("0.0.0.0", None, insecure_no_auth=False)
    check_bind("0.0.0.0", "key", insecure_no_auth=False)
    with caplog.at_level(logging.WARNING, logger="localserve.server.serve"):
        check_bind("0.0.0.0", None, insecure_no_auth=True)
    assert "without an API key (--insecure-no-auth)" in caplog.text
    caplog.clear()
    check_bind("127.0.0.1", None, insecure_no_auth=False)
    check_bind("::1", None, insecure_no_auth=False)
    assert caplog.text == ""  # loopback needs no warning
    result = CliRunner().invoke(main, ["serve", "--host", "0.0.0.0"], env={"LOCALSERVE_API_KEY": ""})
    assert result.exit_code != 0
    assert "without an API key" in result.output
