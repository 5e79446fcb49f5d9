"""The daemon keeps answering while one request is as heavy as the protocol allows: its
prompt is rendered and tokenized off the event loop, and a prompt that could never fit the
context is refused before any tokenizing. Before, one 31 MB request stalled /health and
all traffic for 18 s. A real daemon in its own process, on the built-in demo model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from .test_service import free_port, wait_healthy

LONG_TEXT = "Once upon a time " * 240_000  # 4.08 M characters: just under the protocol's 4 Mi cap


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    home = tmp_path_factory.mktemp("home")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "LOCALSERVE_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen([sys.executable, "-m", "localserve.cli", "serve", "--port", str(port), "--device", "cpu",
                                "--kv-cache-memory", "64MiB"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=env, cwd=home)
    try:
        wait_healthy(url, process)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def _health_while(url: str, send: callable) -> tuple[httpx.Response, list[float]]:  # type: ignore[valid-type]
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(target=lambda: result.setdefault("response", send()))
    worker.start()
    latencies = []
    with httpx.Client(timeout=30) as client:
        while True:  # one poll at least: a quick refusal may end the worker before the first
            start = time.monotonic()
            assert client.get(f"{url}/health").status_code == 200
            latencies.append(time.monotonic() - start)
            if not worker.is_alive():
                break
            time.sleep(0.005)
    worker.join()
    return result["response"], latencies


@pytest.mark.parametrize("kind", ["completion", "chat", "tokenize"])
def test_health_answers_while_a_huge_prompt_is_refused(daemon: str, kind: str) -> None:
    body = {"completion": {"model": "demo", "prompt": LONG_TEXT[: 4 << 20], "max_tokens": 1},
            "chat": {"model": "demo", "messages": [{"role": "user", "content": LONG_TEXT[: 4 << 20]}], "max_tokens": 1},
            "tokenize": {"model": "demo", "prompt": LONG_TEXT[: 4 << 20]}}[kind]
    path = {"completion": "/v1/completions", "chat": "/v1/chat/completions", "tokenize": "/tokenize"}[kind]
    data = json.dumps(body).encode()

    def send() -> httpx.Response:
        return httpx.post(daemon + path, content=data, headers={"Content-Type": "application/json"}, timeout=120)

    response, latencies = _health_while(daemon, send)
    assert response.status_code == 400
    assert "characters" in response.json()["error"]["message"]  # refused untokenized: it cannot fit
    print(f"max /health latency {max(latencies) * 1000:.0f} ms over {len(latencies)} polls")
    assert max(latencies) < 0.1, latencies


def test_health_answers_while_a_long_prompt_is_tokenized(daemon: str) -> None:
    """A prompt just inside the cap (64 characters per token of the demo's 2,048) is
    tokenized in a worker thread while /health keeps answering."""
    text = LONG_TEXT[: 2048 * 64]

    def send() -> httpx.Response:
        return httpx.post(daemon + "/tokenize", json={"model": "demo", "prompt": text}, timeout=120)

    response, latencies = _health_while(daemon, send)
    assert response.status_code == 200 and response.json()["count"] > 2048
    print(f"max /health latency {max(latencies) * 1000:.0f} ms over {len(latencies)} polls")
    assert max(latencies) < 0.1, latencies


def test_a_long_text_is_encoded_as_a_short_one_would_be() -> None:
    """Texts past the GIL-free threshold go through encode_batch: the ids are encode()'s."""
    from localserve.formats import read_tokenizer
    from localserve.text import tokenizer as tokenizer_module

    from .conftest import DATA, STORIES_HF

    text = ("Once upon a time, \u00e9t\u00e9 \U0001f600 " * 2000)[: tokenizer_module._GIL_FREE_CHARS * 3]
    for source in (STORIES_HF, DATA / "tokenizers" / "ggml-vocab-gpt-2.gguf"):
        tokenizer = read_tokenizer(source)
        assert tokenizer is not None
        for special in (True, False):
            assert tokenizer.encode(text, special) == tokenizer.backend.encode(text, add_special_tokens=special).ids
