"""`localserve serve` as a process: SIGTERM lets the request in flight finish, answers
new ones with 503, and exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .server_util import stories_with_template


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_sigterm_drains_then_exits_zero(tmp_path: Path) -> None:
    model = stories_with_template(tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "localserve.cli", "serve", "--model", f"stories={model}", "--port", str(port),
         "--device", "cpu", "--kv-cache-memory", "64MiB", "--drain-timeout", "60", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read().decode()  # type: ignore[union-attr]
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.1)

        # Top-20 logprobs make each event a few KB, so the server cannot push the whole
        # stream into socket buffers: the request stays in flight while we read slowly.
        body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                "temperature": 0, "logprobs": 20, "stream": True}
        with httpx.Client(base_url=url, timeout=60) as client, client.stream("POST", "/v1/completions",
                                                                                json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first.removeprefix("data: "))["choices"][0]["text"]

            process.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(f"{url}/v1/completions", json={"model": "stories", "prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["message"]
            assert httpx.get(f"{url}/health").status_code == 503

            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert 1 + sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == 400
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
