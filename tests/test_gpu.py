"""What only a real GPU can show (skipped elsewhere; the GPU proof, scripts/gpu_proof.sh, runs
them with the other ``gpu``-marked tests, the Triton kernels' own):

- decode steps captured as CUDA graphs at load and replayed give the tokens and logprobs of
  the same engine run eagerly, and transformers' greedy tokens; so do one sequence's steps
  verifying draft tokens (speculative decoding's graphs), and batches of several sequences
  verifying drafts with a draft model whose own steps replay graphs too;
- the sampler on the device draws in proportion to the filtered distribution at a real
  vocabulary, seeded rows repeat, greedy is the argmax.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from localserve import Engine, EngineConfig
from localserve.engine.sampler import Sampler, SamplingRow
from localserve.engine.sampling_params import SamplingParams

from .conftest import hf_greedy, random_prompt
from .test_cuda_graphs import ARRIVALS, run_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_proof.sh)")]


def test_replayed_cuda_graphs_equal_eager_steps_and_transformers(llama) -> None:  # type: ignore[no-untyped-def]
    path, hf = llama
    config = EngineConfig(max_num_seqs=4, num_kv_blocks=48, max_num_batched_tokens=32)
    graphed = Engine(path, config, device="cuda", dtype=torch.float32)
    assert graphed.runner.graphs is not None, "no CUDA graphs were captured at load"
    replayed = run_greedy(graphed)
    eager_engine = Engine(path, dataclasses.replace(config, disable_cuda_graphs=True), device="cuda",
                          dtype=torch.float32)
    assert eager_engine.runner.graphs is None
    eager = run_greedy(eager_engine)
    assert graphed.runner.graphs.replays, "no decode step replayed a graph"
    for request_id, (tokens, logprobs) in eager.items():
        length, max_tokens, _ = ARRIVALS[int(request_id)]
        assert replayed[request_id][0] == tokens, request_id
        assert replayed[request_id][1] == pytest.approx(logprobs, abs=1e-3), request_id
        assert tokens == hf_greedy(hf, random_prompt(length, seed=int(request_id)), max_tokens), request_id


def test_verification_graphs_equal_eager_steps(llama) -> None:  # type: ignore[no-untyped-def]
    """Requests one at a time with prompt lookup drafting every step: the verification
    graphs replayed, the greedy tokens of decoding without drafts and of transformers."""
    from localserve.engine.speculative import SpeculativeConfig

    path, hf = llama
    config = EngineConfig(max_num_seqs=4, num_kv_blocks=48, max_num_batched_tokens=32,
                          speculative=SpeculativeConfig(num_tokens=4, adaptive=False))
    engine = Engine(path, config, device="cuda", dtype=torch.float32)
    graphs = engine.runner.graphs
    assert graphs is not None and sorted(shape.rows for shape in graphs.graphs if shape.kind == "verify") == [2, 3, 4, 5]
    for seed in range(3):
        prompt = random_prompt(6, seed=seed) * 3  # repeats itself: prompt lookup finds drafts
        engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        tokens = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = out.token_ids if out.finished else tokens
        assert tokens == hf_greedy(hf, prompt, 12), seed
    assert any(shape.kind == "verify" for shape in graphs.replays)
    assert engine.speculator.stats.num_drafts > 0


def test_batches_verifying_a_draft_models_drafts_replay_graphs(llama, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """ARRIVALS' requests drafted by a draft model (the model's first layer: both verdicts):
    batches of several sequences verifying drafts replay the batch shapes, the draft's steps
    its own graphs, and every request gets the eager engine's tokens, which are plain greedy
    decoding's."""
    from localserve.engine.speculative import SpeculativeConfig

    from .test_speculative import draft_config, shallow_copy

    path, hf = llama
    config = EngineConfig(max_num_seqs=4, num_kv_blocks=64, max_num_batched_tokens=32,
                          speculative=draft_config(shallow_copy(hf, tmp_path / "draft")))
    engine = Engine(path, config, device="cuda", dtype=torch.float32)
    assert engine.runner.graphs is not None and engine.drafter is not None and engine.drafter.graphs is not None
    replayed = run_greedy(engine)
    eager = run_greedy(Engine(path, dataclasses.replace(config, disable_cuda_graphs=True), device="cuda",
                              dtype=torch.float32))
    plain = run_greedy(Engine(path, dataclasses.replace(config, disable_cuda_graphs=True,
                                                        speculative=SpeculativeConfig()),
                              device="cuda", dtype=torch.float32))
    for request_id, (tokens, _) in eager.items():
        assert replayed[request_id][0] == tokens == plain[request_id][0], request_id
    assert any(shape.kind == "verify batch" for shape in engine.runner.graphs.replays), engine.runner.graphs.replays
    assert sum(engine.drafter.graphs.replays.values()) > 0
    stats = engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def sampling_rows(count: int, seed: int | None = None, **params: object) -> list[SamplingRow]:
    rows = []
    for i in range(count):
        generator = torch.Generator("cuda").manual_seed(seed + i) if seed is not None else None
        rows.append(SamplingRow(SamplingParams(seed=None if seed is None else seed + i, **params), [], [],
                                generator, frozenset()))
    return rows


def test_sampling_on_the_device_follows_the_filtered_distribution() -> None:
    """Llama-3's vocabulary, a spread-out distribution: 4,096 draws at temperature 0.8 with
    top_k 20 and top_p 0.9 land only on the kept tokens, in their renormalised proportions."""
    vocab, draws = 128256, 4096
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    scaled = logits / 0.8
    top = scaled.topk(20)
    probs = torch.softmax(top.values, 0)
    keep = int((probs.cumsum(0) - probs < 0.9).sum())  # the smallest prefix whose mass reaches 0.9
    kept = top.indices[:keep]
    expected = probs[:keep] / probs[:keep].sum()
    batch = logits.float().cuda().expand(draws, -1).contiguous()
    with torch.random.fork_rng(devices=[0]):
        torch.manual_seed(1)
        ids = torch.tensor(Sampler()(batch, sampling_rows(draws, temperature=0.8, top_k=20, top_p=0.9)).token_ids)
    assert set(ids.tolist()) <= set(kept.tolist())
    counts = torch.stack([(ids == token).sum() for token in kept]).double()
    # Each kept token's share within 4 standard deviations of a binomial draw.
    spread = (expected * (1 - expected) / draws).sqrt()
    assert ((counts / draws - expected).abs() <= 4 * spread + 1e-3).all(), (counts / draws, expected)


def test_greedy_and_seeded_rows_on_the_device() -> None:
    logits = torch.randn(8, 128256, device="cuda")
    greedy = Sampler()(logits, sampling_rows(8, temperature=0.0)).token_ids
    assert greedy == logits.argmax(-1).tolist()
    first = Sampler()(logits, sampling_rows(8, seed=7, temperature=1.0)).token_ids
    again = Sampler()(logits, sampling_rows(8, seed=7, temperature=1.0)).token_ids
    assert first == again
