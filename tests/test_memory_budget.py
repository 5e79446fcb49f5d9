"""Sizing the KV pool from memory, and capping the context to what it holds."""

from __future__ import annotations

import logging

import pytest

from localserve import Engine, EngineConfig, LocalserveError, SamplingParams
from localserve.engine.kv_cache import kv_bytes_per_block
from localserve.engine.scheduler import Scheduler
from localserve.engine.memory import CPU_DEFAULT_KV_MEMORY, GiB, kv_budget_bytes


def test_budget_is_utilization_share_less_everything_in_use() -> None:
    # 24 GiB card, 5 GiB in use after loading (weights, context, another process), 1 GiB peak activations.
    assert kv_budget_bytes(24 * GiB, 19 * GiB, 1 * GiB, 0.9) == int(24 * GiB * 0.9) - 5 * GiB - 1 * GiB
    assert kv_budget_bytes(24 * GiB, 19 * GiB, 1 * GiB, 0.9, reserve=GiB // 2) == int(24 * GiB * 0.9) - 6.5 * GiB
    with pytest.raises(LocalserveError, match="no GPU memory left for the KV cache.*gpu_memory_utilization"):
        kv_budget_bytes(12 * GiB, 2 * GiB, 1 * GiB, 0.9)


def test_invalid_options_are_refused() -> None:
    for options in ({"gpu_memory_utilization": 0}, {"gpu_memory_utilization": 1.5}, {"kv_cache_memory": 0},
                    {"cpu_offload_gb": -1}):
        with pytest.raises(LocalserveError, match="invalid engine option"):
            EngineConfig(**options)


def test_step_size_defaults_to_the_device(llama) -> None:
    # The CPU's step is llama.cpp's micro-batch: bigger steps only grow the activations.
    path, _ = llama
    assert Engine(path, device="cpu").config.max_num_batched_tokens == 512
    assert Engine(path, EngineConfig(max_num_batched_tokens=96), device="cpu").scheduler.step_tokens == 96
    assert EngineConfig().step_tokens("cuda") == 2048 and EngineConfig().step_tokens("cpu") == 512
    with pytest.raises(ValueError, match="resolved for a device"):
        Scheduler(EngineConfig(), None)  # type: ignore[arg-type]


def test_pool_from_memory_and_context_capped_with_a_message(llama, caplog) -> None:
    path, _ = llama
    default = Engine(path, device="cpu")
    block_bytes = kv_bytes_per_block(default.spec, 16, default.dtype)
    assert default.stats().kv_blocks_total == CPU_DEFAULT_KV_MEMORY // block_bytes

    caplog.set_level(logging.INFO, logger="localserve")
    engine = Engine(path, EngineConfig(kv_cache_memory=10 * block_bytes), device="cpu")
    assert engine.stats().kv_blocks_total == 10 and engine.max_model_len == 160
    log = caplog.text
    assert "capped to 160" in log and "10 blocks of 16 tokens = 160 tokens" in log
    assert "largest context that fits: 160" in log
    # A request that could never fit is refused at once, not left waiting.
    with pytest.raises(LocalserveError, match="exceeds the context of 160 tokens"):
        engine.add_request(list(range(3, 153)), SamplingParams(max_tokens=20))
    engine.add_request(list(range(3, 143)), SamplingParams(max_tokens=20, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_generated_tokens_total == 20


@pytest.mark.parametrize("options", [{}, {"num_kv_blocks": 7}, {"kv_cache_memory": 64 << 20, "num_cpu_blocks": 5},
                                     {"num_kv_blocks": 9, "cpu_offload_gb": 0.01}])
def test_engine_fit_and_the_daemon_size_the_pools_alike(llama, options: dict) -> None:
    """One rule (memory.pool_sizes): the pools a CPU engine allocates, the host memory the
    daemon expects a load to take, and `localserve fit`'s plan when the options fix the
    pools."""
    from localserve.engine.memory import pool_sizes
    from localserve.facts.fit import plan
    from localserve.formats.weights import weight_sizes
    from localserve.server.config import ServerConfig
    from localserve.server.footprint import needed_bytes

    path, _ = llama
    config = EngineConfig(**options)
    engine = Engine(path, config, device="cpu")
    pools = pool_sizes(engine.config, engine.spec, engine.kv_dtype, "cpu", gpu_budget=lambda: 0)
    assert (engine.kv.device.num_blocks, engine.kv.cpu.num_blocks) == (pools.device_blocks, pools.cpu_blocks)
    if "num_cpu_blocks" in options or "cpu_offload_gb" in options:
        assert pools.cpu_blocks > 0
    weights = weight_sizes(engine.checkpoint, engine.dtype).loaded_bytes
    assert needed_bytes(path, ServerConfig(engine=config, device="cpu")) == weights + pools.total_bytes
    if options:  # fixed by the options, the GPU plan has the same pools
        fit = plan(path, 24 * GiB, config, dtype=engine.dtype)
        assert (fit.kv_blocks, fit.cpu_blocks) == (pools.device_blocks, pools.cpu_blocks)
