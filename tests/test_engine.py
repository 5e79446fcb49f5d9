"""Continuous batching end to end against HF transformers' one-at-a-time generate."""

from __future__ import annotations

import pytest

from localserve import LLM, Engine, EngineConfig, LocalserveError, SamplingParams

from .conftest import hf_greedy, random_prompt

PROMPT_LENGTHS = [1, 2, 5, 16, 17, 31, 33, 64, 100, 128, 150, 200, 250, 280, 299, 300]
MAX_TOKENS = [1, 24, 7, 16, 3, 20, 12, 9, 24, 5, 17, 2, 11, 24, 8, 15]
PROMPTS = [random_prompt(n, seed=100 + i) for i, n in enumerate(PROMPT_LENGTHS)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_expected(llama) -> list[list[int]]:
    _, hf = llama
    return [hf_greedy(hf, p, m) for p, m in zip(PROMPTS, MAX_TOKENS)]


def run_engine(engine: Engine, prompts, max_tokens) -> tuple[list[list[int]], dict]:
    """Submit everything at once, step to the end; also watch KV waste each step."""
    ids = [engine.add_request(p, greedy(m)) for p, m in zip(prompts, max_tokens)]
    results: dict[str, list[int]] = {}
    peak_waste_ratio, steps, mixed_steps = 0.0, 0, 0
    block_size = engine.config.block_size
    while engine.has_unfinished_requests():
        running_before = list(engine.scheduler.running)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.token_ids
        steps += 1
        running = [r for r in engine.scheduler.running if r.block_table]
        allocated = sum(len(r.block_table) for r in running) * block_size
        used = sum(r.num_computed_tokens for r in running)
        # Allocated but unused slots stay under one block per running sequence.
        assert allocated - used < max(len(running), 1) * block_size
        if allocated:
            peak_waste_ratio = max(peak_waste_ratio, (allocated - used) / allocated)
        prefilling = [r for r in running_before if r.num_computed_tokens < r.num_prompt_tokens]
        mixed_steps += bool(prefilling) and len(running_before) > len(prefilling)
    return [results[i] for i in ids], {"steps": steps, "peak_waste": peak_waste_ratio, "mixed": mixed_steps}


def test_batched_greedy_equals_transformers_one_at_a_time(llama, hf_expected) -> None:
    path, _ = llama
    # A small budget forces chunked prefills mixed with running decodes.
    engine = Engine(path, EngineConfig(max_num_batched_tokens=48, num_kv_blocks=512), device="cpu")
    outputs, info = run_engine(engine, PROMPTS, MAX_TOKENS)
    print(f"\nsteps {info['steps']}, steps mixing prefill chunks with decodes {info['mixed']}, "
          f"peak KV waste {info['peak_waste']:.1%} of allocated slots")
    assert info["mixed"] > 0
    for i, (ours, expected) in enumerate(zip(outputs, hf_expected)):
        assert ours == expected, f"request {i} (prompt {PROMPT_LENGTHS[i]} tokens) differs"
    assert engine.stats().kv_blocks_used == 0


def test_alone_equals_inside_batch(llama) -> None:
    path, _ = llama
    engine = Engine(path, EngineConfig(max_num_batched_tokens=64, num_kv_blocks=512), device="cpu")
    batched, _ = run_engine(engine, PROMPTS, MAX_TOKENS)
    for index in (0, 9, 15):
        alone, _ = run_engine(engine, [PROMPTS[index]], [MAX_TOKENS[index]])
        assert alone[0] == batched[index]


def test_small_pool_preempts_and_still_matches(llama, hf_expected) -> None:
    path, _ = llama
    # 40 blocks hold 640 tokens: the longest request alone needs 21 blocks.
    engine = Engine(path, EngineConfig(max_num_batched_tokens=128, num_kv_blocks=40), device="cpu")
    outputs, _ = run_engine(engine, PROMPTS, MAX_TOKENS)
    stats = engine.stats()
    print(f"\npreemptions: {stats.num_preemptions}")
    assert stats.num_preemptions > 0
    assert outputs == hf_expected
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


def test_max_num_seqs_and_budget_respected(llama) -> None:
    path, _ = llama
    engine = Engine(path, EngineConfig(max_num_seqs=3, max_num_batched_tokens=20, num_kv_blocks=256), device="cpu")
    batches = []
    schedule = engine.scheduler.schedule

    def recording_schedule():  # type: ignore[no-untyped-def]
        batch = schedule()
        batches.append((len(batch.requests), batch.num_tokens))
        return batch

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    for p in PROMPTS[:8]:
        engine.add_request(p, greedy(4))
    while engine.has_unfinished_requests():
        engine.step()
    assert max(n for n, _ in batches) == 3 and max(t for _, t in batches) == 20
    assert engine.kv.device.num_used == 0


def test_abort_frees_blocks_at_once(llama) -> None:
    path, _ = llama
    engine = Engine(path, EngineConfig(num_kv_blocks=64), device="cpu")
    rid = engine.add_request(PROMPTS[12], greedy(20))
    other = engine.add_request(PROMPTS[3], greedy(20))
    engine.step()
    assert engine.stats().kv_blocks_used > 0
    engine.abort(rid)
    assert engine.stats().kv_blocks_used == 1  # the other request's one block
    engine.abort(other)
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished_requests()


def test_bad_requests_get_clear_errors(llama) -> None:
    path, _ = llama
    engine = Engine(path, EngineConfig(num_kv_blocks=8, max_model_len=128), device="cpu")
    with pytest.raises(LocalserveError, match="exceeds the context"):
        engine.add_request(random_prompt(120, seed=0), greedy(20))
    with pytest.raises(LocalserveError, match="token ids"):
        engine.add_request([5, 100000], greedy(2))
    with pytest.raises(LocalserveError, match="empty"):
        engine.add_request([], greedy(2))
    with pytest.raises(LocalserveError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(LocalserveError, match="max_model_len"):
        Engine(path, EngineConfig(max_model_len=10**6), device="cpu")
    # The engine still serves after refusing bad input.
    engine.add_request([5, 6, 7], greedy(2))
    while engine.has_unfinished_requests():
        engine.step()


def test_llm_generate_api(llama, hf_expected) -> None:
    path, _ = llama
    llm = LLM(path, device="cpu", num_kv_blocks=512, max_num_batched_tokens=256)
    params = [greedy(m) for m in MAX_TOKENS[:4]]
    outputs = llm.generate(PROMPTS[:4], params)
    assert [o.token_ids for o in outputs] == hf_expected[:4]
    assert all(o.finish_reason == "length" for o in outputs)
    single = llm.generate(PROMPTS[1], greedy(MAX_TOKENS[1]))
    assert single[0].token_ids == hf_expected[1]
    stats = llm.stats()
    assert stats.kv_blocks_total == 512 and stats.kv_blocks_used == 0
    assert stats.num_running == stats.num_waiting == stats.num_preemptions == 0
    with pytest.raises(LocalserveError, match="unknown engine option"):
        LLM(path, device="cpu", not_an_option=1)
