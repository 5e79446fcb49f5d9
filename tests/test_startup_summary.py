"""The block the daemon logs once it is ready: its text on made-up facts, the facts read
from a running server, and `localserve serve` writing it to the journal with the real
URL, version and model."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localserve import __version__
from localserve.server.config import ServerConfig
from localserve.server.startup import ModelFacts, StartupFacts, log_startup_summary, startup_facts, startup_summary

from .server_util import running_server, small_engine_config, stories_with_template
from .test_service import free_port, logged_on_a_terminal, wait_healthy

GIB = 1 << 30


def _model(**overrides: object) -> ModelFacts:
    fields: dict[str, object] = dict(name="llama3.2:1b-q4_k_m", architecture="llama", format="gguf",
                                     quantization="Q4_K 81%", weights_bytes=808 << 20, host_weights_bytes=0,
                                     kv_tokens=65_536, kv_bytes=2 * GIB, kv_dtype="float32", max_num_seqs=64,
                                     max_model_len=2048)
    return ModelFacts(**{**fields, **overrides})  # type: ignore[arg-type]


def test_the_block_on_a_cpu_host() -> None:
    facts = StartupFacts(host="127.0.0.1", port=8000, device="cpu", device_name="AMD EPYC 7B13", threads=2,
                         cpu_kernels="avx2", models=[_model()], on_demand=[f"m{i}:latest" for i in range(7)],
                         ollama_port=11434, version="1.2.3")
    assert startup_summary(facts).splitlines() == [
        "localserve 1.2.3 is ready",
        "  device     cpu: AMD EPYC 7B13, 2 threads, CPU kernels avx2",
        "  model      llama3.2:1b-q4_k_m: llama, gguf Q4_K 81%, weights 808.00 MiB",
        "             KV cache: 65,536 tokens (2.00 GiB fp32) shared by up to 64 sequences of at most 2,048 tokens",
        "  on demand  7 models, loaded on first request: m0:latest, m1:latest, m2:latest, m3:latest, m4:latest "
        "and 2 more (localserve list)",
        "  OpenAI     http://127.0.0.1:8000/v1",
        "  Ollama     http://127.0.0.1:8000 and http://127.0.0.1:11434",
        "  dashboard  localserve top",
    ]


def test_the_block_on_a_gpu_listening_everywhere() -> None:
    moe = _model(name="qwen3-moe", architecture="qwen3_moe", weights_bytes=3 * GIB, host_weights_bytes=14 * GIB,
                 kv_tokens=262_144, kv_bytes=GIB, kv_dtype="bfloat16", max_num_seqs=256, max_model_len=40_960,
                 cpu_kv_tokens=131_072, cpu_kv_bytes=GIB // 2)
    facts = StartupFacts(host="0.0.0.0", port=9000, device="cuda:0", device_name="NVIDIA H100 80GB HBM3",
                         models=[moe], failed=["broken"], api_key=True, version="1.2.3")
    lines = startup_summary(facts).splitlines()
    assert lines[1] == "  device     cuda:0: NVIDIA H100 80GB HBM3"  # no threads or CPU kernels on a GPU
    assert lines[2].endswith("weights 3.00 GiB (+ 14.00 GiB of experts in host memory)")
    assert lines[3] == ("             KV cache: 262,144 tokens (1.00 GiB bf16) shared by up to 256 sequences of at "
                        "most 40,960 tokens; 131,072 more (512.00 MiB) in host memory for sequences swapped out")
    assert lines[4] == "  model      broken: not loaded (the error is above)"
    # Reached on loopback from this host; `localserve top` needs the URL off the default port.
    assert "  OpenAI     http://127.0.0.1:9000/v1" in lines and "  Ollama     http://127.0.0.1:9000" in lines
    assert "  dashboard  localserve top --url http://127.0.0.1:9000" in lines
    assert any(line.startswith("  API key    required") for line in lines)
    assert any(line.startswith("  listening  on every address") for line in lines)
    assert not any("on demand" in line for line in lines)
    bare = startup_summary(StartupFacts(host="::1", port=8001, device="cpu", device_name="", threads=1))
    assert "  device     cpu, 1 thread, torch reference kernels" in bare.splitlines()
    assert "  model      none loaded yet" in bare.splitlines() and "http://[::1]:8001/v1" in bare


def test_the_facts_of_a_running_server(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = stories_with_template(tmp_path)
    config = ServerConfig(models={"stories": path, "spare": path}, preload=["stories", "missing"],
                          registry_home=tmp_path / "home", engine=small_engine_config(threads=1), device="cpu")
    with running_server(config) as server:
        facts = startup_facts(server.state, "127.0.0.1", server.port)
        engine = server.state.manager.loaded["stories"].engine.engine
        caplog.set_level(logging.INFO, logger="localserve.server.startup")
        log_startup_summary(server.state, "127.0.0.1", server.port)
        [record] = [r for r in caplog.records if r.name == "localserve.server.startup"]
        port = server.port
    assert facts.device == "cpu" and facts.threads == 1 and facts.version == __version__
    [model] = facts.models
    assert (model.name, model.architecture, model.format, model.quantization) == ("stories", "llama", "safetensors",
                                                                                  "float32")
    assert model.kv_tokens == engine.kv.device.num_blocks * 16 and 0 < model.kv_bytes <= 64 << 20
    assert (model.max_num_seqs, model.max_model_len, model.kv_dtype) == (64, engine.max_model_len, "float32")
    assert model.weights_bytes > 0
    assert facts.failed == ["missing"]
    assert facts.on_demand == ["spare", "demo:latest"]  # the other --model name, the registry's built-in model
    text = startup_summary(facts)
    assert f"KV cache: {model.kv_tokens:,} tokens" in text and f"of at most {engine.max_model_len:,} tokens" in text
    assert record.levelno == logging.INFO and record.getMessage() == text  # one record: the whole block
    # On a terminal (rich, 80 columns here) the block's short lines come out whole and uncoloured.
    shown = logged_on_a_terminal(record)
    for line in text.splitlines():
        if len(line) < 40:
            assert line.strip() in shown
    assert f"localserve {__version__} is ready" in shown and f"http://127.0.0.1:{port}/v1" in shown


def test_serve_logs_the_block_once_ready(tmp_path: Path) -> None:
    """`localserve serve` under systemd (its stdout the journal's stream): the block comes
    once the model is loaded, every line at info priority, with the URLs it listens on."""
    path = stories_with_template(tmp_path)
    port, ollama = free_port(), free_port()
    log = tmp_path / "journal.log"
    with log.open("wb") as stdout:
        info = os.fstat(stdout.fileno())
        env = {**os.environ, "JOURNAL_STREAM": f"{info.st_dev}:{info.st_ino}",
               "LOCALSERVE_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
        env.pop("NOTIFY_SOCKET", None)
        process = subprocess.Popen([sys.executable, "-m", "localserve.cli", "serve", "--port", str(port),
                                    "--ollama-port", str(ollama), "--device", "cpu", "--model", f"stories={path}",
                                    "--kv-cache-memory", "64MiB", "--threads", "1"],
                                   stdout=stdout, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process)
        deadline = time.monotonic() + 30
        while "is ready" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(timeout=60)
    lines = log.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "is ready" in line)
    assert lines[start] == f"<6>localserve.server.startup: localserve {__version__} is ready"
    block = lines[start:start + 8]
    assert all(line.startswith("<6>  ") for line in block[1:]), block
    text = "\n".join(block)
    assert "cpu: " in text and "1 thread, " in text
    assert "model      stories: llama, safetensors float32, weights " in text
    assert "KV cache: " in text and "shared by up to 64 sequences of at most " in text
    assert "on demand  1 model, loaded on first request: demo:latest" in text
    assert f"OpenAI     http://127.0.0.1:{port}/v1" in text
    assert f"Ollama     http://127.0.0.1:{port} and http://127.0.0.1:{ollama}" in text
    assert f"dashboard  localserve top --url http://127.0.0.1:{port}" in text
    assert sum("is ready" in line for line in lines) == 1  # once
