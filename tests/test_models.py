"""Our forward pass against HF transformers on the same checkpoint (fp32)."""

from __future__ import annotations

import pytest
import torch

from localserve import Engine, EngineConfig, SamplingParams
from localserve.engine.request import Request
from localserve.engine.runner import prepare_inputs
from localserve.engine.scheduler import ScheduledBatch

from .conftest import (MODEL_KINDS, SCALED_ROPE_KINDS, SLIDING_KINDS, hf_greedy, hf_logits, random_prompt,
                       relative_error)

TOLERANCE = 1e-4


def greedy_outputs(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens, all submitted at once and stepped to the end."""
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), str(i))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outputs.update({out.request_id: out.token_ids for out in engine.step() if out.finished})
    return [outputs[str(i)] for i in range(len(prompts))]


def all_logits(engine: Engine, prompts: list[list[int]], chunks: list[int] | None = None) -> list[torch.Tensor]:
    """Logits at every position of each prompt, all prompts in one flat batch per
    step; ``chunks`` splits each prompt's prefill into pieces of these sizes."""
    requests = [Request(str(i), p, SamplingParams(), frozenset()) for i, p in enumerate(prompts)]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    pending = {r.request_id: list(chunks or [len(r.prompt_token_ids)]) for r in requests}
    while any(r.num_computed_tokens < r.num_tokens for r in requests):
        batch = ScheduledBatch()
        for r in requests:
            if r.num_computed_tokens < r.num_tokens:
                n = min(pending[r.request_id].pop(0) if pending[r.request_id] else r.num_tokens,
                        r.num_tokens - r.num_computed_tokens)
                assert engine.kv.try_allocate(r, n)
                batch.add(r, n)
        inputs = prepare_inputs(batch, engine.config.block_size, engine.device)
        with torch.inference_mode():
            hidden = engine.model(inputs.input_ids, inputs.positions, engine.runner.kv_caches, inputs.meta)
            step_logits = engine.model.compute_logits(hidden).float()
        start = 0
        for r, n in zip(batch.requests, batch.num_new_tokens):
            logits[int(r.request_id)].append(step_logits[start : start + n])
            r.num_computed_tokens += n
            start += n
    for r in requests:
        engine.kv.free(r)
    return [torch.cat(parts) for parts in logits]


@pytest.mark.parametrize("kind", [kind for kind in MODEL_KINDS if kind not in SCALED_ROPE_KINDS])
def test_logits_match_transformers(tiny_models, kind: str) -> None:
    path, hf = tiny_models.get(kind)
    engine = Engine(path, EngineConfig(num_kv_blocks=64), device="cpu", dtype=torch.float32)
    # Lengths past 64 exercise the llama3/yarn long-context scaling and block crossings.
    prompts = [random_prompt(n, seed=n) for n in (1, 17, 100)]
    for prompt, ours in zip(prompts, all_logits(engine, prompts)):
        error = relative_error(ours, hf_logits(hf, prompt))
        assert error <= TOLERANCE, f"{kind}: relative max error {error:.2e} for length {len(prompt)}"


@pytest.mark.parametrize("kind", ["llama", "qwen3", *SLIDING_KINDS])
def test_chunked_prefill_logits_match(tiny_models, kind: str) -> None:
    """Prefill in chunks (cached context + new chunk, crossing block boundaries; for the
    sliding-window kinds, chunks starting far past the window of 12)."""
    path, hf = tiny_models.get(kind)
    engine = Engine(path, EngineConfig(num_kv_blocks=64), device="cpu", dtype=torch.float32)
    prompts = [random_prompt(90, seed=1), random_prompt(45, seed=2)]
    for prompt, ours in zip(prompts, all_logits(engine, prompts, chunks=[7, 16, 30, 1])):
        assert relative_error(ours, hf_logits(hf, prompt)) <= TOLERANCE


@pytest.mark.parametrize("save_dtype,shard_size", [(torch.bfloat16, None), (torch.float16, "40KB")])
def test_half_precision_and_sharded_checkpoints(tiny_models, save_dtype, shard_size) -> None:
    path, hf = tiny_models.get("qwen2", save_dtype=save_dtype, shard_size=shard_size)
    if shard_size:
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) > 1
    engine = Engine(path, EngineConfig(num_kv_blocks=16), device="cpu", dtype=torch.float32)
    prompt = random_prompt(40, seed=3)
    assert relative_error(all_logits(engine, [prompt])[0], hf_logits(hf, prompt)) <= TOLERANCE


@pytest.mark.parametrize("kind", SLIDING_KINDS)
def test_sliding_window_greedy_matches_transformers(tiny_models, kind: str) -> None:
    """A batch of prompts shorter and longer than the window of 12, prefilled in 16-token
    chunks beside running decodes, generates what transformers does: the context is the
    model's own, not capped at the window."""
    path, hf = tiny_models.get(kind)
    engine = Engine(path, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16), device="cpu",
                    dtype=torch.float32)
    assert engine.max_model_len == 1024
    prompts = [random_prompt(n, seed=n) for n in (5, 20, 41)]
    for prompt, tokens in zip(prompts, greedy_outputs(engine, prompts, 10)):
        assert tokens == hf_greedy(hf, prompt, 10), f"{kind}: prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("kind", SCALED_ROPE_KINDS)
def test_scaled_rope_follows_the_served_context(tiny_models, kind: str) -> None:
    """transformers picks dynamic NTK's base and longrope's factor set by each forward's
    length; here the served context picks them once. Served at the pre-trained 64 tokens
    (longrope: short factors; dynamic: the plain base), a 40-token prompt equals
    transformers; served at 100 (longrope: long factors; dynamic: the base for 100), a
    100-token prompt, which transformers runs with the same settings, equals it too."""
    path, hf = tiny_models.get(kind)
    short, long = random_prompt(40, seed=7), random_prompt(100, seed=8)
    results = {}
    for context, prompt in ((64, short), (100, long)):
        engine = Engine(path, EngineConfig(num_kv_blocks=64, max_model_len=context), device="cpu",
                        dtype=torch.float32)
        assert engine.max_model_len == context
        ours = all_logits(engine, [prompt])[0]
        error = relative_error(ours, hf_logits(hf, prompt))
        assert error <= TOLERANCE, f"{kind} at context {context}: relative max error {error:.2e}"
        results[context] = all_logits(engine, [short])[0]
    # The two contexts rotate differently: the scaling did something.
    assert relative_error(results[100], results[64]) > 1e-2
