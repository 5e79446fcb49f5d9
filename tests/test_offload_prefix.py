"""Memory under pressure, end to end: swapping to the CPU tier, recomputation when
that is full too, prefix caching (device and CPU tier), and no leaks under aborts."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from localserve import Engine, EngineConfig
from localserve.server.metrics import EngineCollector

from .conftest import random_prompt
from .test_engine import MAX_TOKENS, PROMPTS, greedy, run_engine


@pytest.fixture(scope="module")
def unconstrained(llama) -> list[list[int]]:
    path, _ = llama
    engine = Engine(path, EngineConfig(max_num_batched_tokens=128, num_kv_blocks=1024), device="cpu")
    outputs, _ = run_engine(engine, PROMPTS, MAX_TOKENS)
    return outputs


def blocks_needed(block_size: int = 16) -> int:
    return sum(-(-(len(p) + m) // block_size) for p, m in zip(PROMPTS, MAX_TOKENS))


def assert_no_leaks(engine: Engine) -> None:
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.cpu_blocks_used == 0
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0


def test_swap_keeps_outputs_and_avoids_recompute(llama, unconstrained) -> None:
    path, _ = llama
    device_blocks = blocks_needed() // 4  # the workload needs four times the device pool
    engine = Engine(path, EngineConfig(max_num_batched_tokens=128, num_kv_blocks=device_blocks, num_cpu_blocks=256),
                    device="cpu")
    outputs, _ = run_engine(engine, PROMPTS, MAX_TOKENS)
    stats = engine.stats()
    print(f"\n{blocks_needed()} blocks needed, {device_blocks} on the device: {stats.num_preemptions} preemptions, "
          f"{stats.swap_out_blocks} blocks out, {stats.swap_in_blocks} in, {stats.num_recomputes} recomputes")
    assert outputs == unconstrained
    assert stats.swap_out_blocks > 0 and stats.swap_in_blocks == stats.swap_out_blocks
    assert stats.num_recomputes == 0
    assert_no_leaks(engine)


def test_recompute_takes_over_when_the_cpu_tier_is_full(llama, unconstrained) -> None:
    path, _ = llama
    engine = Engine(path, EngineConfig(max_num_batched_tokens=128, num_kv_blocks=blocks_needed() // 4, num_cpu_blocks=6),
                    device="cpu")
    outputs, _ = run_engine(engine, PROMPTS, MAX_TOKENS)
    stats = engine.stats()
    print(f"\nsmall CPU tier: {stats.swap_out_blocks} blocks swapped out, {stats.num_recomputes} recomputes")
    assert outputs == unconstrained
    assert stats.num_recomputes > 0
    assert_no_leaks(engine)


def test_random_aborts_leak_nothing(llama) -> None:
    path, _ = llama
    engine = Engine(path, EngineConfig(max_num_batched_tokens=96, num_kv_blocks=40, num_cpu_blocks=8), device="cpu")
    rng = random.Random(7)
    shared = random_prompt(64, seed=3)
    ids: list[str] = []
    saw_swapped_abort = False
    step = 0
    while step < 300 or engine.has_unfinished_requests():
        step += 1
        if step < 300 and rng.random() < 0.4:
            prompt = shared + random_prompt(rng.randint(1, 120), seed=step) if rng.random() < 0.5 else \
                random_prompt(rng.randint(1, 200), seed=step)
            ids.append(engine.add_request(prompt, greedy(rng.randint(1, 40))))
        if ids and rng.random() < 0.08:
            swapped = [r.request_id for r in engine.scheduler.swapped]
            victim = swapped[0] if swapped and rng.random() < 0.5 else rng.choice(ids)
            saw_swapped_abort |= victim in swapped
            ids.remove(victim)
            engine.abort(victim)
        for out in engine.step():
            if out.finished and out.request_id in ids:
                ids.remove(out.request_id)
    stats = engine.stats()
    print(f"\n{stats.num_preemptions} preemptions, {stats.swap_out_blocks} blocks swapped out, "
          f"{stats.num_recomputes} recomputes, prefix hits {stats.prefix_cache_hits} tokens; "
          f"aborted a swapped request: {saw_swapped_abort}")
    assert stats.swap_out_blocks > 0 and stats.num_recomputes > 0 and stats.prefix_cache_hits > 0
    assert saw_swapped_abort
    assert_no_leaks(engine)
    assert metrics_of(stats) == {
        "localserve_num_preemptions_total": stats.num_preemptions,
        "localserve_num_recomputes_total": stats.num_recomputes,
        "localserve_kv_blocks_swapped_out_total": stats.swap_out_blocks,
        "localserve_kv_blocks_swapped_in_total": stats.swap_in_blocks,
    }


def metrics_of(stats) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The preemption and swap counters /metrics exposes for these statistics, as prometheus_client
    parses them."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: {"m": stats}))
    wanted = ("localserve_num_preemptions_total", "localserve_num_recomputes_total",
              "localserve_kv_blocks_swapped_out_total", "localserve_kv_blocks_swapped_in_total")
    return {sample.name: sample.value for family in text_string_to_metric_families(generate_latest(registry).decode())
            for sample in family.samples if sample.name in wanted}


def run_one(engine: Engine, prompt: list[int], max_tokens: int = 12) -> list[int]:
    outputs, _ = run_engine(engine, [prompt], [max_tokens])
    return outputs[0]


def test_shared_prefix_computes_only_the_suffix(llama) -> None:
    path, _ = llama
    prefix = random_prompt(256, seed=21)
    first, second = prefix + random_prompt(9, seed=22), prefix + random_prompt(30, seed=23)
    plain = Engine(path, EngineConfig(num_kv_blocks=128, enable_prefix_caching=False), device="cpu")
    expected = [run_one(plain, first), run_one(plain, second)]
    assert plain.stats().prefix_cache_hits == 0

    engine = Engine(path, EngineConfig(num_kv_blocks=128), device="cpu")
    assert run_one(engine, first) == expected[0]
    computed_before = engine.stats().num_prompt_tokens_total
    assert run_one(engine, second) == expected[1]
    stats = engine.stats()
    assert stats.prefix_cache_hits == 256
    assert stats.num_prompt_tokens_total - computed_before == 30  # only the suffix
    # Running both at once shares the blocks between live requests too.
    both, _ = run_engine(engine, [first, second], [12, 12])
    assert both == expected


def test_prefix_evicted_to_cpu_tier_comes_back(llama) -> None:
    path, _ = llama
    prefix = random_prompt(160, seed=31)  # 10 full blocks
    target = prefix + random_prompt(7, seed=32)
    plain = Engine(path, EngineConfig(num_kv_blocks=64, enable_prefix_caching=False), device="cpu")
    expected = run_one(plain, target)

    engine = Engine(path, EngineConfig(num_kv_blocks=24, num_cpu_blocks=32), device="cpu")
    run_one(engine, prefix + random_prompt(5, seed=33))
    # Unrelated prompts that need the whole device pool evict the prefix's blocks.
    for seed in range(2):
        run_one(engine, random_prompt(300, seed=40 + seed), max_tokens=4)
    assert engine.stats().cpu_blocks_used == 0  # spilled blocks are cached, not held
    assert engine.kv.cpu.num_cached > 0
    assert run_one(engine, target) == expected
    stats = engine.stats()
    print(f"\nprefix hits {stats.prefix_cache_hits} tokens, {stats.prefix_cache_cpu_hits} from the CPU tier")
    assert stats.prefix_cache_hits == stats.prefix_cache_cpu_hits == 160
    assert_no_leaks(engine)
