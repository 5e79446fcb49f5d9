"""Prompt logprobs against transformers' log_softmax over the same prompt (fp32): whole,
in prefill chunks, past prefix-cache hits, and across preemption with recompute."""

from __future__ import annotations

import pytest
import torch

from localserve import Engine, EngineConfig, LocalserveError, RequestOutput, SamplingParams
from localserve.engine.kv_cache import BlockPool, KVCacheManager
from localserve.engine.request import Request
from localserve.engine.outputs import TokenLogprobs

from .conftest import hf_logits, random_prompt
from .test_engine import PROMPTS

ATOL = 1e-4


def params(prompt_logprobs: int | None, max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs)


def run(engine: Engine, prompts: list[list[int]], sampling: list[SamplingParams]) -> list[list[RequestOutput]]:
    """Every output of each request, in order."""
    ids = [engine.add_request(p, s) for p, s in zip(prompts, sampling)]
    outputs: dict[str, list[RequestOutput]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return [outputs[i] for i in ids]


def assert_matches_transformers(ours: list[TokenLogprobs] | None, hf, prompt: list[int], n: int) -> None:  # type: ignore[no-untyped-def]
    reference = torch.log_softmax(hf_logits(hf, prompt), dim=-1)
    assert ours is not None and len(ours) == len(prompt) - 1
    for p, entry in enumerate(ours):
        assert entry.token_id == prompt[p + 1]
        assert entry.logprob == pytest.approx(reference[p, prompt[p + 1]].item(), abs=ATOL)
        top_values, top_ids = reference[p].topk(n)
        assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=ATOL)
        # The same ids, up to the order of values closer than ATOL.
        for (token, value), expected in zip(entry.top, top_ids.tolist()):
            assert token == expected or abs(reference[p, expected].item() - value) <= ATOL
            assert value == pytest.approx(reference[p, token].item(), abs=ATOL)


def test_prompt_logprobs_match_transformers(llama) -> None:
    path, hf = llama
    engine = Engine(path, EngineConfig(num_kv_blocks=64), device="cpu")
    prompts = [random_prompt(n, seed=40 + n) for n in (1, 2, 17, 40)]
    tops = [3, 0, 20, 5]
    results = run(engine, prompts + [prompts[3]], [params(n) for n in tops] + [params(None)])
    for prompt, n, outputs in zip(prompts, tops, results):
        assert_matches_transformers(outputs[0].prompt_logprobs, hf, prompt, n)
        assert all(o.prompt_logprobs is outputs[0].prompt_logprobs for o in outputs)
    assert results[0][0].prompt_logprobs == []  # a one-token prompt has nothing to report
    assert all(o.prompt_logprobs is None for o in results[4])
    # Asking for prompt logprobs changes nothing about what is generated.
    assert results[3][-1].token_ids == results[4][-1].token_ids


def test_chunked_prefill_reports_every_position_once(llama) -> None:
    path, hf = llama
    engine = Engine(path, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=7), device="cpu")
    prompts = [random_prompt(50, seed=1), random_prompt(23, seed=2)]
    steps_before_first_output = 0
    ids = [engine.add_request(p, params(2)) for p in prompts]
    first: dict[str, RequestOutput] = {}
    while len(first) < len(ids):
        steps_before_first_output += len(first) == 0
        first.update((o.request_id, o) for o in engine.step() if o.request_id not in first)
    assert steps_before_first_output > 5  # the prompts really were split over many steps
    for prompt, rid in zip(prompts, ids):
        assert_matches_transformers(first[rid].prompt_logprobs, hf, prompt, 2)


def test_prefix_cache_hits_do_not_skip_prompt_positions(llama) -> None:
    path, hf = llama
    engine = Engine(path, EngineConfig(num_kv_blocks=64, block_size=16), device="cpu")
    shared = random_prompt(48, seed=3)
    run(engine, [shared + [5]], [params(None)])  # caches three full blocks of `shared`
    hits = engine.stats().prefix_cache_hits
    longer = shared + random_prompt(10, seed=4)
    [outputs] = run(engine, [longer], [params(4)])
    assert engine.stats().prefix_cache_hits == hits  # it computed its whole prompt
    assert_matches_transformers(outputs[0].prompt_logprobs, hf, longer, 4)
    # Its own blocks are still cached for others.
    fresh = random_prompt(40, seed=6)
    run(engine, [fresh], [params(1)])
    run(engine, [fresh + [9, 9]], [params(None)])
    assert engine.stats().prefix_cache_hits == hits + 32


def test_recompute_after_preemption_does_not_repeat_entries(llama) -> None:
    path, hf = llama
    # 30 blocks for ~110 blocks of work and no CPU tier: preempted requests recompute.
    engine = Engine(path, EngineConfig(max_num_batched_tokens=128, num_kv_blocks=30), device="cpu")
    prompts = PROMPTS[:12]
    results = run(engine, prompts, [params(1, max_tokens=20) for _ in prompts])
    assert engine.stats().num_recomputes > 0
    for prompt, outputs in zip(prompts, results):
        assert_matches_transformers(outputs[0].prompt_logprobs, hf, prompt, 1)
        assert outputs[-1].prompt_logprobs is outputs[0].prompt_logprobs
        assert len(outputs[-1].prompt_logprobs) == len(prompt) - 1


def test_prefix_hit_stops_where_prompt_logprobs_are_owed() -> None:
    kv = KVCacheManager(BlockPool(16), BlockPool(0), block_size=4)
    prompt = list(range(10, 24))  # 14 tokens: three full blocks can be a hit
    first = Request("a", prompt, SamplingParams(), frozenset())
    kv.admit(first, kv.find_cached_prefix(first), first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    kv.cache_full_blocks(first)
    asking = Request("b", prompt, SamplingParams(prompt_logprobs=0), frozenset())
    assert kv.find_cached_prefix(asking).num_tokens == 0
    asking.prompt_logprobs = [TokenLogprobs(0, 0.0, [])] * 9  # positions 0..8 recorded (before a recompute)
    assert kv.find_cached_prefix(asking).num_tokens == 8
    asking.prompt_logprobs = [TokenLogprobs(0, 0.0, [])] * 13  # all recorded: nothing is owed any more
    assert kv.find_cached_prefix(asking).num_tokens == 12


def test_prompt_logprobs_range() -> None:
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
    for bad in (-1, 21):
        with pytest.raises(LocalserveError, match="prompt_logprobs must be in"):
            SamplingParams(prompt_logprobs=bad)
