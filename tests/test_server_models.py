"""The model manager through the API: loading on demand, keep_alive, LRU unloading,
503 while loading, and the admin endpoints."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from safetensors import safe_open

from localserve.engine.engine import Engine
from localserve.engine.stats import EngineStats, LoadProgress
from localserve.server.app import open_engine
from localserve.server.catalog import CatalogEntry, ModelCatalog
from localserve.server.config import ServerConfig
from localserve.server.model_manager import ManagerOptions, ModelManager, ModelUnavailableError, parse_keep_alive

from .server_util import running_server, small_engine_config, stories_with_template, wait_until

COMPLETION = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stories_with_template(tmp_path_factory.mktemp("models"))


def config_for(path: Path, **changes: object) -> ServerConfig:
    return ServerConfig(**{"models": {"a": path, "b": path}, "engine": small_engine_config(), "device": "cpu",
                           **changes})  # type: ignore[arg-type]


def complete(url: str, model: str, **extra: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, **COMPLETION, **extra}, timeout=60)


def loaded(url: str) -> list[str]:
    return [m["name"] for m in httpx.get(f"{url}/api/ps").json()["models"]]


@pytest.mark.parametrize("value, seconds", [
    (None, None), (300, 300.0), (0, 0.0), (-1, math.inf), ("5m", 300.0), ("1h30m", 5400.0), ("90s", 90.0),
    ("0", 0.0), ("-1", math.inf), ("-1m", math.inf), ("1.5h", 5400.0), ("250ms", 0.25), ("42", 42.0),
])
def test_parse_keep_alive(value: object, seconds: float | None) -> None:
    assert parse_keep_alive(value) == seconds  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["soon", "5 minutes", "m", "", "5x", True, float("nan"), 1e18, float("inf"),
                                   "inf", "87601h", 10 * 365 * 24 * 3600 + 1])
def test_parse_keep_alive_refuses(value: object) -> None:
    with pytest.raises(ValueError):
        parse_keep_alive(value)  # type: ignore[arg-type]


def test_loads_on_demand_and_unloads_the_least_recently_used(model_path: Path) -> None:
    with running_server(config_for(model_path, max_loaded_models=1)) as server:
        assert loaded(server.url) == []
        assert complete(server.url, "a").status_code == 200
        assert loaded(server.url) == ["a"]
        assert complete(server.url, "b").status_code == 200
        assert loaded(server.url) == ["b"]  # a was idle and least recently used


def test_keep_alive_per_request(model_path: Path) -> None:
    with running_server(config_for(model_path)) as server:
        assert complete(server.url, "a", keep_alive="1s").status_code == 200
        assert complete(server.url, "b", keep_alive=-1).status_code == 200
        models = {m["name"]: m for m in httpx.get(f"{server.url}/api/ps").json()["models"]}
        assert models["a"]["keep_alive_s"] == 1.0 and models["a"]["expires_at"] is not None
        assert models["b"]["keep_alive_s"] is None and models["b"]["expires_at"] is None  # forever
        assert wait_until(lambda: loaded(server.url) == ["b"], timeout=5)
        assert complete(server.url, "b", keep_alive=0).status_code == 200
        assert wait_until(lambda: loaded(server.url) == [], timeout=5)
        assert complete(server.url, "a").status_code == 200  # loads again


def test_admin_load_unload_stats(model_path: Path) -> None:
    with running_server(config_for(model_path)) as server:
        url = server.url
        response = httpx.post(f"{url}/api/localserve/load", json={"model": "a", "keep_alive": "10m"}, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["keep_alive_s"] == 600.0
        assert response.json()["memory"]["kv_cache_bytes"] > 0
        assert complete(url, "a").status_code == 200
        time.sleep(0.3)
        stats = httpx.get(f"{url}/api/localserve/stats").json()
        assert stats["known_models"] == ["a", "b"] and stats["ready"] is True
        (model,) = stats["models"]
        # One schema: the engine's typed snapshot, every field by its name.
        assert set(model["engine"]) == {f.name for f in dataclasses.fields(EngineStats)}
        assert model["engine"]["num_generated_tokens_total"] >= 3
        assert model["engine"]["generation_tokens_per_s"] > 0
        assert model["recent"]["requests"] == 1 and model["recent"]["ttft_ms_p50"] > 0
        assert httpx.post(f"{url}/api/localserve/unload", json={"model": "a"}).json() == {"model": "a", "unloaded": True}
        assert loaded(url) == []
        assert httpx.post(f"{url}/api/localserve/unload", json={"model": "zz"}).status_code == 404
        assert httpx.post(f"{url}/api/localserve/load", json={"model": "zz"}).status_code == 404
        assert httpx.get(f"{url}/api/version").json()["version"]


def test_loading_answers_503_to_clients_that_will_not_wait(model_path: Path) -> None:
    config = config_for(model_path, preload=["a"])
    real = open_engine(config)

    def slow(entry: CatalogEntry, progress: LoadProgress):  # type: ignore[no-untyped-def]
        time.sleep(1.5)
        return real(entry, progress)

    with running_server(config, load=slow, wait_ready=False) as server:
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and health.headers["retry-after"]
        response = httpx.post(f"{server.url}/v1/completions", json={"model": "a", **COMPLETION},
                              headers={"Prefer": "wait=0"})
        assert response.status_code == 503
        assert response.headers["retry-after"]
        assert response.json()["error"]["code"] == "model_unavailable"
        assert complete(server.url, "a").status_code == 200  # waits for the load
        assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_model_being_loaded_is_in_the_stats_with_its_progress_and_waiting_requests(model_path: Path) -> None:
    """Before, a loading model was nowhere in the stats: 8 requests waited 11 s while the
    dashboard showed nothing."""
    config = config_for(model_path)
    real = open_engine(config)
    go = threading.Event()

    def held(entry: CatalogEntry, progress: LoadProgress):  # type: ignore[no-untyped-def]
        progress.step("loading weights", total=10)
        progress.done = 4
        go.wait(30)
        return real(entry, progress)

    def loading() -> list[dict]:
        return httpx.get(f"{server.url}/api/localserve/stats").json()["loading"]

    with running_server(config, load=held) as server, ThreadPoolExecutor(3) as pool:
        answers = [pool.submit(complete, server.url, "a") for _ in range(3)]
        assert wait_until(lambda: loading() and loading()[0]["requests_waiting"] == 3)
        [entry] = loading()
        assert entry["name"] == "a" and entry["phase"] == "loading weights" and entry["fraction"] == 0.4
        assert entry["elapsed_s"] >= 0
        go.set()
        assert [answer.result().status_code for answer in answers] == [200] * 3
        assert loading() == []


def test_the_engine_reports_its_load_progress(model_path: Path) -> None:
    progress = LoadProgress()
    Engine(model_path, small_engine_config(), device="cpu", progress=progress)
    assert progress.phase == "sizing the KV cache" and progress.total == 0  # the last step on a CPU
    seen: list[tuple[str, int, int]] = []

    class Watched(LoadProgress):
        def step(self, phase: str, total: int = 0) -> None:
            if self.phase == "loading weights":
                seen.append((self.phase, self.done, self.total))
            super().step(phase, total)

    Engine(model_path, small_engine_config(), device="cpu", progress=Watched())
    with safe_open(model_path / "model.safetensors", "pt") as weights:
        tensors = len(list(weights.keys()))
    assert seen == [("loading weights", tensors, tensors)]  # every tensor counted, then the next step


class FakeEngine:
    """Stands in for an AsyncEngine where only the manager's bookkeeping is tested."""

    def __init__(self) -> None:
        self.shut_down = False
        self.dead = False

    def shutdown(self) -> None:
        self.shut_down = True


def test_unloads_idle_models_when_memory_is_short() -> None:
    available = {"bytes": 10}
    engines: dict[str, FakeEngine] = {}

    def load(entry: CatalogEntry, progress: LoadProgress) -> FakeEngine:
        engines[entry.name] = FakeEngine()
        available["bytes"] -= 4
        return engines[entry.name]

    def unload_returns_memory(name: str) -> None:
        available["bytes"] += 4

    options = ManagerOptions(max_loaded_models=10, needed_bytes=lambda path: 4,
                             available_bytes=lambda: available["bytes"])
    sources = {name: Path(name) for name in "abcd"}

    async def run() -> None:
        manager = ModelManager(ModelCatalog(sources), load, options)  # type: ignore[arg-type]
        original_unload = manager.unload

        async def unload(name: str, reason: str = "requested") -> bool:
            unloaded = await original_unload(name, reason)
            if unloaded:
                unload_returns_memory(name)
            return unloaded

        manager.unload = unload  # type: ignore[method-assign]
        a = await manager.acquire("a")
        await manager.load("b")
        manager.release(a)  # a is now idle, and used after b
        assert sorted(manager.loaded) == ["a", "b"] and available["bytes"] == 2
        await manager.load("c")  # needs 4, 2 available: b (least recently used idle) goes
        assert sorted(manager.loaded) == ["a", "c"] and engines["b"].shut_down
        held = [await manager.acquire("a"), await manager.acquire("c")]
        await manager.load("d")  # nothing idle: tries anyway (the estimate may be pessimistic)
        assert sorted(manager.loaded) == ["a", "c", "d"]
        for model in held:
            manager.release(model)

    asyncio.run(run())


def test_limit_reached_with_every_model_busy_is_503() -> None:
    async def run() -> None:
        manager = ModelManager(ModelCatalog({"a": Path("a"), "b": Path("b")}), lambda entry, progress: FakeEngine(),  # type: ignore[arg-type,return-value]
                               ManagerOptions(max_loaded_models=1))
        await manager.acquire("a")
        with pytest.raises(ModelUnavailableError) as raised:
            await manager.load("b")
        assert raised.value.retry_after > 0

    asyncio.run(run())


def test_full_queue_is_429(model_path: Path) -> None:
    config = config_for(model_path, engine=small_engine_config(max_num_seqs=1), max_queued_requests=0)
    with running_server(config) as server:
        assert complete(server.url, "a").status_code == 200  # loaded

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                body = {"model": "a", "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
                return list(await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(4))))

        statuses = sorted(response.status_code for response in asyncio.run(run()))
        assert statuses[0] == 200 and statuses[-1] == 429
        refused = next(r for r in asyncio.run(run()) if r.status_code == 429)
        assert refused.headers["retry-after"] and refused.json()["error"]["code"] == "queue_full"
