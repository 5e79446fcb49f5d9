"""What /api/localserve/stats tells the dashboard beyond the engine's counters: uptime, the host,
each model's format and quantization, latency percentiles, and the event log; token rates
that fall to 0 when idle, and in-flight counts that agree with the scheduler's."""

from __future__ import annotations

import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from localserve.facts.checkpoint import model_info
from localserve.registry import open_registry
from localserve.registry.local import import_local
from localserve.server.config import ServerConfig
from localserve.server.events import EventLog
from localserve.server.metrics import _percentiles

from .conftest import STORIES_HF
from .server_util import running_server, small_engine_config


def events(url: str) -> list[dict]:
    return httpx.get(f"{url}/api/localserve/stats").json()["events"]


def test_stats_describe_the_host_the_models_and_what_happened(tmp_path: Path) -> None:
    config = ServerConfig(models={"stories": STORIES_HF}, preload=["stories"], registry_home=tmp_path / "home",
                          engine=small_engine_config(), device="cpu")
    with running_server(config) as server:
        stats = httpx.get(f"{server.url}/api/localserve/stats").json()
        assert stats["uptime_s"] >= 0 and stats["started_at"].endswith("+00:00")
        host = stats["host"]
        assert host["device"] == "cpu" and host["device_name"] and host["gpus"] == []
        assert host["memory_total_bytes"] == psutil.virtual_memory().total
        assert 0 < host["memory_used_bytes"] < host["memory_total_bytes"] and 0 <= host["cpu_percent"] <= 100
        (model,) = stats["models"]
        info, _ = model_info(STORIES_HF)
        assert (model["format"], model["quantization"]) == ("safetensors", info["quantization"])
        (load,) = stats["events"]
        assert load["kind"] == "load" and load["model"] == "stories" and load["seq"] == 1

        import_local(open_registry(tmp_path / "home"), STORIES_HF, "fresh")
        assert [(e["kind"], e["model"]) for e in events(server.url)[1:]] == [("pull", "fresh:latest")]
        open_registry(tmp_path / "home").remove("fresh")
        assert events(server.url)[-1]["kind"] == "remove"  # noticed at the next look
        httpx.post(f"{server.url}/api/localserve/unload", json={"model": "stories"})
        later = events(server.url)
        assert [(e["kind"], e["model"]) for e in later[1:]] == [("pull", "fresh:latest"), ("remove", "fresh:latest"),
                                                                 ("unload", "stories")]
        assert later[-1]["message"] == "unloaded (requested)"
        assert [e["seq"] for e in later] == [1, 2, 3, 4]


def test_a_failed_load_and_a_500_are_events(tmp_path: Path) -> None:
    def broken(entry: object, progress: object):  # type: ignore[no-untyped-def]
        raise RuntimeError("the device caught fire")

    config = ServerConfig(models={"stories": STORIES_HF}, engine=small_engine_config(), device="cpu")
    with running_server(config, load=broken) as server:
        answer = httpx.post(f"{server.url}/v1/completions", json={"model": "stories", "prompt": "hi"})
        assert answer.status_code == 500
        request_id = answer.headers["x-request-id"]
        assert request_id in answer.json()["error"]["message"]
        assert [(e["kind"], e["model"], e["message"]) for e in events(server.url)] == [
            ("load_failed", "stories", "the device caught fire"),
            ("error", None, f"RuntimeError serving POST /v1/completions (request id {request_id})")]


def test_the_event_log_is_bounded_and_numbered() -> None:
    log = EventLog()
    log.note_registry(["a"])  # the first look only remembers
    for i in range(150):
        log.add("load", f"m{i}", "loaded")
    recent = log.recent()
    assert len(recent) == 100 and [e["seq"] for e in recent] == list(range(51, 151))
    log.note_registry(["b"])
    assert [(e["kind"], e["model"]) for e in log.recent()[-2:]] == [("pull", "b"), ("remove", "a")]


def test_latency_percentiles() -> None:
    values = [i / 1000 for i in range(1, 201)]  # 1..200 ms
    summary = _percentiles("ttft_ms", values)
    assert summary["ttft_ms_p50"] == round(statistics.median(values) * 1000, 2) == 100.5
    assert 198 <= summary["ttft_ms_p99"] <= 200
    assert _percentiles("tpot_ms", []) == {"tpot_ms_p50": None, "tpot_ms_p99": None}
    assert _percentiles("tpot_ms", [0.004]) == {"tpot_ms_p50": 4.0, "tpot_ms_p99": 4.0}


def test_token_rates_fall_to_zero_once_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, an idle engine's rates froze at their last busy value (the dashboard showed
    631.7 tok/s minutes after the load ended). A 1 s window here, 10 s in the daemon."""
    from localserve.engine import async_engine
    from localserve.engine.async_engine import AsyncEngine
    from localserve.engine.engine import Engine
    from localserve.engine.sampling_params import SamplingParams

    monkeypatch.setattr(async_engine, "_RATE_WINDOW_S", 1.0)
    engine = AsyncEngine(lambda: Engine(STORIES_HF, small_engine_config(), device="cpu"))

    async def generate() -> None:
        stream = await engine.add_request([1, 403, 407], SamplingParams(max_tokens=32, ignore_eos=True))
        async for _ in stream:
            pass

    try:
        asyncio.run(generate())
        deadline = time.monotonic() + 1
        while time.monotonic() < deadline and not engine.stats.generation_tokens_per_s:  # type: ignore[union-attr]
            time.sleep(0.01)
        assert engine.stats.generation_tokens_per_s > 0  # type: ignore[union-attr,operator]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (engine.stats.generation_tokens_per_s  # type: ignore[union-attr]
                                               or engine.stats.prompt_tokens_per_s):  # type: ignore[union-attr]
            time.sleep(0.05)
        assert engine.stats.generation_tokens_per_s == 0 and engine.stats.prompt_tokens_per_s == 0  # type: ignore[union-attr]
    finally:
        engine.shutdown()


def test_in_flight_counts_agree_with_the_scheduler(tmp_path: Path) -> None:
    """The models table's "in flight" and the scheduler panel's counts come from one
    snapshot (before: a live count beside a 0.25 s-old one, "in flight 1" beside "running 8")."""
    config = ServerConfig(models={"stories": STORIES_HF}, preload=["stories"], engine=small_engine_config(),
                          device="cpu")
    body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True}
    with running_server(config) as server, httpx.Client(timeout=60) as client:
        with ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(client.post, f"{server.url}/v1/completions", json=body) for _ in range(4)]
            seen = set()
            while not all(answer.done() for answer in answers):
                [model] = client.get(f"{server.url}/api/localserve/stats").json()["models"]
                engine = model["engine"]
                assert model["requests_in_flight"] == engine["num_running"] + engine["num_waiting"] + \
                    engine["num_swapped"]
                seen.add(model["requests_in_flight"])
            assert max(seen) == 4
