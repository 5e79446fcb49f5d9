"""Sizing the KV pool from memory, and capping the context to what it holds."""

from __future__ import annotations

import logging

import pytest

from localserve import Engine, EngineConfig, LocalserveError, SamplingParams
from localserve.engine.kv_cache import kv_bytes_per_block
from localserve.engine.scheduler import Scheduler
from localserve.engine import memory
from localserve.engine.host_memory import HostMemory
from localserve.engine.memory import GiB, kv_budget_bytes

from .conftest import STORIES_HF


def host_memory(monkeypatch: pytest.MonkeyPatch, available: int) -> None:
    """Make the host's available memory ``available`` bytes, wherever it is read."""
    monkeypatch.setattr(memory, "available_host_memory", lambda: HostMemory(available, "a test"))


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


def test_pool_from_memory_and_context_capped_with_a_message(llama, caplog, monkeypatch) -> None:
    path, _ = llama
    host_memory(monkeypatch, 16 * GiB)
    default = Engine(path, device="cpu")  # 64 sequences of the model's 1,024 tokens
    block_bytes = kv_bytes_per_block(default.spec, 16, default.dtype)
    assert default.stats().kv_blocks_total == 64 * 1024 // 16

    caplog.set_level(logging.INFO, logger="localserve")
    engine = Engine(path, EngineConfig(kv_cache_memory=10 * block_bytes), device="cpu")
    assert engine.stats().kv_blocks_total == 10 and engine.max_model_len == 160
    log = caplog.text
    assert "capped to 160" in log and "10 blocks of 16 tokens = 160 tokens" in log and "kv_cache_memory set" in log
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
def test_engine_fit_and_the_daemon_size_the_pools_alike(llama, options: dict, monkeypatch) -> None:
    """One rule (memory.pool_sizes): the pools a CPU engine allocates, the host memory the
    daemon expects a load to take, and `localserve fit`'s plan for the CPU, and for a GPU
    when the options fix the pools."""
    from localserve.engine.memory import pool_sizes
    from localserve.facts.fit import plan
    from localserve.formats.weights import weight_sizes
    from localserve.server.footprint import needed_bytes

    path, _ = llama
    host_memory(monkeypatch, 16 * GiB)
    config = EngineConfig(**options)
    engine = Engine(path, config, device="cpu")
    pools = pool_sizes(engine.config, engine.spec, engine.kv_dtype, "cpu", gpu_budget=lambda: 0)
    assert (engine.kv.device.num_blocks, engine.kv.cpu.num_blocks) == (pools.device_blocks, pools.cpu_blocks)
    if "num_cpu_blocks" in options or "cpu_offload_gb" in options:
        assert pools.cpu_blocks > 0
    weights = weight_sizes(engine.checkpoint, engine.dtype).loaded_bytes
    assert needed_bytes(path, config, "cpu", None) == weights + pools.total_bytes
    cpu_plan = plan(path, None, config)
    assert (cpu_plan.kv_blocks, cpu_plan.cpu_blocks) == (pools.device_blocks, pools.cpu_blocks)
    if options:  # fixed by the options, the GPU plan has the same pools
        fit = plan(path, 24 * GiB, config, dtype=engine.dtype)
        assert (fit.kv_blocks, fit.cpu_blocks) == (pools.device_blocks, pools.cpu_blocks)


def test_cpu_default_pool_is_sized_for_the_sequences_within_free_memory(monkeypatch, caplog) -> None:
    """Without kv_cache_memory or num_kv_blocks a CPU engine's pool holds max_num_seqs
    sequences of the context (not a fixed 2 GiB: a 1 MiB model sat at 2.4 GB), at most a
    quarter of the free memory, yet one full sequence where half of it holds one; the
    engine logs how it was sized."""
    # stories260K: 5 layers, 4 KV heads of 8, a 512-token context; K and V in fp32.
    per_token = 2 * 5 * 4 * 8 * 4
    sequence = 512 * per_token  # 640 KiB
    caplog.set_level(logging.INFO, logger="localserve")

    def pool(available: int, **options: int) -> tuple[int, int]:
        host_memory(monkeypatch, available)
        engine = Engine(STORIES_HF, EngineConfig(**options), device="cpu")
        assert kv_bytes_per_block(engine.spec, 16, engine.kv_dtype) == 16 * per_token
        return engine.stats().kv_blocks_total, engine.max_model_len

    assert pool(20 * GiB) == (64 * 512 // 16, 512)  # 40 MiB, far below 2 GiB
    assert ("KV cache on cpu: 2048 blocks of 16 tokens = 32768 tokens (0.04 GiB, float32), sized for 64 sequences "
            "of 512 tokens; 25% of 20.00 GiB free would allow more;") in caplog.text
    assert pool(20 * GiB, max_num_seqs=4, max_model_len=256) == (4 * 256 // 16, 256)
    # 64 MiB free: a quarter, 16 MiB, is less than the 40 MiB wanted.
    assert pool(64 << 20) == ((16 << 20) // (16 * per_token), 512)
    assert "capped to 25% of 64.00 MiB free; 64 sequences of 512 tokens would take 40.00 MiB" in caplog.text
    # 2 MiB free: a quarter holds less than one sequence, half of it holds one.
    assert pool(2 << 20) == (sequence // (16 * per_token), 512)
    assert "one sequence of 512 tokens, more than 25% of 2.00 MiB free" in caplog.text
    # 1 MiB free: not even that; the context shrinks to the quarter, with the engine's warning.
    assert pool(1 << 20) == ((256 << 10) // (16 * per_token), 192)
    assert "capped to 25% of 1.00 MiB free, less than one sequence" in caplog.text
    assert "max_model_len 512 capped to 192" in caplog.text
    # Options that fix the pool are kept exactly, whatever the memory.
    assert pool(1 << 20, num_kv_blocks=300) == (300, 512)
    assert pool(1 << 20, kv_cache_memory=100 * 16 * per_token) == (100, 512)


@pytest.mark.parametrize("options, share", [({}, 1), ({"kv_cache_memory": 64 << 20}, 2)])
def test_a_draft_models_cache_shares_the_pools_budget(llama, options: dict, share: int,  # type: ignore[no-untyped-def]
                                                      monkeypatch) -> None:
    """With a draft model each block of the pool comes with one of the draft's, paid from
    the same budget: a given kv_cache_memory holds fewer blocks, the CPU's default asks for
    both pools' room for its sequences; the daemon's estimate and /api/ps count the draft's
    weights and cache."""
    from localserve.engine.speculative import SpeculativeConfig
    from localserve.facts.fit import plan
    from localserve.formats.weights import weight_sizes
    from localserve.server.footprint import memory_footprint, needed_bytes

    path, _ = llama
    host_memory(monkeypatch, 16 * GiB)
    plain = Engine(path, EngineConfig(**options), device="cpu")
    config = EngineConfig(**options, speculative=SpeculativeConfig(method="draft_model", draft_model=str(path),
                                                                    num_tokens=2))
    engine = Engine(path, config, device="cpu")
    assert engine.draft is not None
    block = kv_bytes_per_block(engine.spec, config.block_size, engine.kv_dtype)
    draft_block = engine.draft.block_bytes(config.block_size)
    assert draft_block == block  # the model drafting for itself
    assert engine.kv.device.num_blocks == plain.kv.device.num_blocks // share
    assert engine.speculator.drafter.pool.num_blocks == engine.kv.device.num_blocks  # type: ignore[attr-defined]
    weights = weight_sizes(engine.checkpoint, engine.dtype).loaded_bytes
    footprint = memory_footprint(engine)
    assert footprint["weights_bytes"] == 2 * weights
    assert footprint["kv_cache_bytes"] == engine.kv.device.num_blocks * 2 * block
    assert needed_bytes(path, config, "cpu", None) == \
        footprint["weights_bytes"] + footprint["kv_cache_bytes"]
    fit = plan(path, None, config)  # `localserve fit` plans the same pools
    assert fit.kv_blocks == engine.kv.device.num_blocks and fit.draft_weight_bytes == weights

