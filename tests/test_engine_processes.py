"""Each model's engine in a process of its own (`serve --engine-processes`): the daemon never
imports torch while its engine process does; a killed engine process fails its requests,
not the daemon, and is loaded again by the next request; an unload ends the process; a file
that cannot load leaves no process behind. (The API itself is checked in both modes by
test_server_api.py and test_embeddings.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from localserve.server.config import ServerConfig

from .server_util import running_server, small_engine_config, stories_with_template, wait_until
from .gguf_writers import STORIES_GGUF
from .test_service import free_port, wait_healthy

STORY = ", there was a little girl named Lily. She loved to play outside in the park."


def engine_processes() -> list[psutil.Process]:
    return [child for child in psutil.Process().children(recursive=True)
            if "localserve.server.engine_process" in " ".join(child.cmdline())]


def maps_torch(pid: int) -> bool:
    """Whether the process has torch's library mapped: imported, not merely named."""
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = stories_with_template(tmp_path)
    config = ServerConfig(models={"stories": path}, preload=["stories"], engine=small_engine_config(), device="cpu",
                          engine_processes=True)
    with running_server(config) as running:
        yield running
    assert wait_until(lambda: not engine_processes(), timeout=30), "the engine process outlived the daemon"


def story(server) -> str:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    return client.completions.create(model="stories", prompt="Once upon a time", max_tokens=12,
                                     temperature=0).choices[0].text


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_daemon_never_imports_torch_and_an_idle_daemon_keeps_a_spare_engine_process(tmp_path: Path) -> None:
    """`serve` (engine processes are its default): the model preloaded at start runs in a
    process of its own that has torch mapped, the daemon never has; once idle, the daemon
    starts a spare, and the next model's load takes it (no new process) and is served."""
    port = free_port()
    path = stories_with_template(tmp_path)
    env = {**os.environ, "LOCALSERVE_HOME": str(tmp_path / "home")}
    # A registry model: loaded when first asked for (the --model ones load at start).
    subprocess.run([sys.executable, "-m", "localserve.cli", "pull", str(STORIES_GGUF), "--name", "tiny"], env=env,
                   check=True, capture_output=True, timeout=120)
    process = subprocess.Popen([sys.executable, "-m", "localserve.cli", "serve", "--model", f"stories={path}",
                                "--port", str(port), "--device", "cpu", "--insecure-no-auth",
                                "--kv-cache-memory", str(64 << 20)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def workers() -> list[psutil.Process]:
        return [child for child in psutil.Process(process.pid).children()
                if "localserve.server.engine_process" in " ".join(child.cmdline())]

    def complete(model: str) -> str:
        answer = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": model, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0})
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["text"]

    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process)
        assert STORY.startswith(complete("stories"))
        [stories] = workers()
        assert wait_until(lambda: len(workers()) == 2, timeout=30), "no spare once idle"
        pids = {worker.pid for worker in workers()}
        assert wait_until(lambda: all(maps_torch(pid) for pid in pids), timeout=30)  # the spare has imported torch
        assert not maps_torch(process.pid)
        assert STORY.startswith(complete("tiny"))
        # Checked at once: a new spare waits for 2 s of idleness after the request.
        assert {worker.pid for worker in workers()} == pids, "the load started a process of its own"
        assert stories.is_running() and not maps_torch(process.pid)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert wait_until(lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                                          for pid in pids), 30), "an engine process outlived the daemon"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def test_a_killed_engine_process_fails_its_requests_and_the_next_request_loads_it_again(server) -> None:  # type: ignore[no-untyped-def]
    assert STORY.startswith(story(server))
    [worker] = engine_processes()
    body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        worker.kill()
        rest = list(lines)
    errors = [line for line in rest if line.startswith("data: ") and '"error"' in line]
    assert len(errors) == 1 and "engine process ended" in errors[0], rest
    assert rest[-1] == "data: [DONE]" or rest[-2:] == ["data: [DONE]", ""], rest
    # The daemon serves on: the model loads again in a new process.
    assert STORY.startswith(story(server))
    [new_worker] = engine_processes()
    assert new_worker.pid != worker.pid
    reasons = [event["message"] for event in server.state.events.recent() if event["kind"] == "unload"]
    assert any("engine process ended" in reason for reason in reasons), reasons


def test_an_unload_ends_the_engine_process(server) -> None:  # type: ignore[no-untyped-def]
    [worker] = engine_processes()
    answer = httpx.post(f"{server.url}/api/generate", json={"model": "stories", "keep_alive": 0}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert wait_until(lambda: not engine_processes(), timeout=30)
    assert not worker.is_running()


def test_a_file_that_cannot_load_leaves_no_process(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    config = ServerConfig(models={"bad": bad}, engine=small_engine_config(), device="cpu", engine_processes=True)
    with running_server(config) as running:
        answer = httpx.post(f"{running.url}/v1/completions", json={"model": "bad", "prompt": "hi"}, timeout=60)
        assert 400 <= answer.status_code < 500, answer.text
        message = answer.json()["error"]["message"]
        assert "\n" not in message and "bad.gguf" in message
        assert wait_until(lambda: not engine_processes(), timeout=30)


def test_an_engine_process_refuses_a_load_that_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside other models, the engine process estimates the load as the daemon's manager
    does for a thread, and refuses it as short of memory (the manager then unloads an idle
    model and tries again)."""
    from localserve.engine import host_memory
    from localserve.errors import InsufficientMemoryError
    from localserve.server.engine_process.__main__ import _check_room
    from localserve.server.footprint import needed_bytes

    load = {"path": str(STORIES_GGUF), "name": "tiny", "device": "cpu", "dtype": None}
    config = small_engine_config()
    needed = needed_bytes(STORIES_GGUF, config, "cpu", None)
    assert needed is not None and needed > 64 << 20  # the 64 MiB pool and the weights
    monkeypatch.setattr(host_memory, "available_host_memory", lambda: host_memory.HostMemory(needed, "a test"))
    _check_room(load, config)
    monkeypatch.setattr(host_memory, "available_host_memory", lambda: host_memory.HostMemory(needed - 1, "a test"))
    with pytest.raises(InsufficientMemoryError, match=f"needs ~{needed >> 20} MiB"):
        _check_room(load, config)


def test_a_process_that_refused_a_load_for_memory_takes_the_retry() -> None:
    """A load refused as short of memory (before anything was allocated) keeps its process,
    torch imported, as the daemon's spare: the manager's retry (after it unloaded a model)
    takes it instead of starting another and waiting for torch again."""
    import dataclasses

    from localserve.engine.stats import LoadProgress
    from localserve.errors import InsufficientMemoryError
    from localserve.server.engine_process import spawn
    from localserve.server.engine_process.remote import RemoteEngine

    config = small_engine_config()
    too_big = dataclasses.replace(config, kv_cache_memory=1 << 50)  # a pool no host has
    with pytest.raises(InsufficientMemoryError, match="needs ~"):
        RemoteEngine(STORIES_GGUF, "tiny", too_big, "cpu", None, 8, LoadProgress(), check_room=True)
    [refused] = engine_processes()
    engine = RemoteEngine(STORIES_GGUF, "tiny", config, "cpu", None, 8, LoadProgress(), check_room=True)
    try:
        assert [process.pid for process in engine_processes()] == [refused.pid]
        assert engine.engine.kv_tokens > 0
    finally:
        engine.shutdown()
    assert wait_until(lambda: not engine_processes(), timeout=30)
    assert spawn.take_spare() is None


def test_what_crosses_to_an_engine_process_arrives_as_it_was_sent() -> None:
    """Every field of a request's settings survives the JSON frames (token ids as dict keys
    and tuples included), and outputs sent as their new parts add up to the cumulative ones."""
    import socket as sockets

    from localserve.engine.output_format import OutputFormat
    from localserve.engine.outputs import RequestOutput, TokenLogprobs
    from localserve.engine.sampling_params import PoolingParams, SamplingParams
    from localserve.server.engine_process import wire

    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.1,
                            presence_penalty=0.2, frequency_penalty=0.3, seed=4, stop=["x"], stop_token_ids=[2],
                            include_stop_str_in_output=True, ignore_eos=True, min_tokens=1, logprobs=3,
                            prompt_logprobs=1, logit_bias={17: -2.5}, skip_special_tokens=False,
                            output_format=OutputFormat("json", {"type": "object"}), thinking_end=(5, 6),
                            thinking_budget=9, num_speculative_tokens=2, speculative_method="ngram")
    a, b = sockets.socketpair()
    with a, b:
        wire.send(a, {"params": wire.sampling_params_to_wire(params),
                      "pooling": wire.pooling_to_wire(PoolingParams(dimensions=8, normalize=False))})
        received = wire.receive(b)
    assert wire.sampling_params_from_wire(received["params"]) == params
    assert wire.pooling_from_wire(received["pooling"]) == PoolingParams(dimensions=8, normalize=False)

    def output(tokens: list[int], text: str, delta: str, finished: bool) -> RequestOutput:
        return RequestOutput("r", [1, 2], tokens, text, delta, finished, "stop" if finished else None,
                             [TokenLogprobs(t, -0.5, [(t, -0.5)]) for t in tokens],
                             [TokenLogprobs(2, -1.0, [])], 10.0, 10.5, 11.0, 12.0 if finished else None)

    sent = [output([7], "Once", "Once", False), output([7, 8, 9], "Once upon", " upon", False),
            output([7, 8, 9, 4], "Once upon a", " a", True)]
    previous, sent_tokens, sent_logprobs = None, 0, 0
    for original in sent:
        frame = wire.output_to_wire(original, sent_tokens, sent_logprobs)
        sent_tokens, sent_logprobs = len(original.token_ids), len(original.logprobs or ())
        previous = wire.output_from_wire(frame, previous, [1, 2], clock_offset=0.0)
        assert previous == original
    assert len(frame["tokens"]) == 1, "only what is new crosses"


def test_an_engine_process_that_dies_while_loading_is_one_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """A process killed mid-load (the kernel's OOM killer, a crash) leaves the load failed
    with its exit status, not a broken-pipe traceback."""
    import socket as sockets

    from localserve.engine.stats import LoadProgress
    from localserve.server.engine_process import remote

    def dies_after_its_load_frame() -> tuple[subprocess.Popen[bytes], sockets.socket]:
        parent, child = sockets.socketpair()
        with child:
            process = subprocess.Popen([sys.executable, "-c", "import socket, sys\n"
                                        "socket.socket(fileno=int(sys.argv[1])).recv(4)\nsys.exit(3)",
                                        str(child.fileno())], pass_fds=[child.fileno()])
        return process, parent

    monkeypatch.setattr(remote, "take_spare", lambda: None)
    monkeypatch.setattr(remote, "spawn", dies_after_its_load_frame)
    with pytest.raises(RuntimeError, match=r"ended while loading stories \(exit status 3\)"):
        remote.RemoteEngine(stories_with_template(tmp_path), "stories", small_engine_config(), "cpu", None, 8,
                            LoadProgress())
