"""Mixtral, Qwen2-MoE and Qwen3-MoE end to end against transformers (their logits are
checked with the dense kinds in test_models.py): 16 concurrent requests, parameter
counts, and experts kept in host memory (cpu_moe)."""

from __future__ import annotations

import pytest
import torch

from localserve import Engine, EngineConfig, LocalserveError
from localserve.formats import open_checkpoint

from .conftest import MODEL_KINDS, MOE_KINDS, hf_greedy, random_prompt
from .test_engine import run_engine
from .test_models import all_logits

PROMPT_LENGTHS = [1, 3, 9, 16, 17, 25, 40, 64, 70, 90, 5, 33, 48, 2, 120, 11]
MAX_TOKENS = [12, 4, 9, 12, 1, 7, 12, 3, 10, 12, 6, 12, 2, 12, 8, 5]
PROMPTS = [random_prompt(n, seed=300 + i) for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_sixteen_concurrent_requests_equal_transformers_one_at_a_time(tiny_models, kind: str) -> None:
    path, hf = tiny_models.get(kind)
    expected = [hf_greedy(hf, p, m) for p, m in zip(PROMPTS, MAX_TOKENS)]
    # A small token budget mixes prefill chunks with decodes, so one step routes tokens
    # of many sequences (and positions) through the experts together.
    engine = Engine(path, EngineConfig(max_num_batched_tokens=40, num_kv_blocks=256), device="cpu")
    outputs, info = run_engine(engine, PROMPTS, MAX_TOKENS)
    assert info["mixed"] > 0
    for i, (ours, reference) in enumerate(zip(outputs, expected)):
        assert ours == reference, f"{kind}: request {i} ({PROMPT_LENGTHS[i]} prompt tokens) differs"


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_parameter_counts_equal_transformers(tiny_models, kind: str) -> None:
    path, hf = tiny_models.get(kind)
    counts = open_checkpoint(path).spec.parameter_counts()
    assert counts.total == hf.num_parameters()
    # Active: everything but the experts a token is not routed to, counted from the
    # transformers model's own expert tensors.
    config = hf.config
    skipped = 0
    for name, param in hf.named_parameters():
        if ".experts." in name:
            experts = param.shape[0]
            skipped += param.numel() * (experts - config.num_experts_per_tok) // experts
    assert counts.active == hf.num_parameters() - skipped
    assert (counts.active < counts.total) == (kind in MOE_KINDS)


def test_routing_matters(tiny_models) -> None:
    """The tiny models' routers are not near-uniform: forcing other experts changes the
    output, so the logits tests above do check routing."""
    path, _ = tiny_models.get("mixtral")
    engine = Engine(path, EngineConfig(num_kv_blocks=16), device="cpu", dtype=torch.float32)
    prompt = random_prompt(30, seed=5)
    before = all_logits(engine, [prompt])[0]
    for layer in engine.model.layers:
        layer.mlp.router.weights[0].neg_()  # every token now picks its least favoured experts
    after = all_logits(engine, [prompt])[0]
    assert (before - after).abs().max() > 0.1 * before.abs().max()


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_cpu_moe_keeps_experts_in_host_memory_with_equal_outputs(tiny_models, kind: str) -> None:
    """On a GPU the experts of the first N layers (or all) stay on the CPU while the rest
    of the model is on CUDA; without one, everything is on the CPU already and this
    checks only that the option changes nothing."""
    path, _ = tiny_models.get(kind)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    prompts = [random_prompt(n, seed=n) for n in (5, 40)]
    reference = all_logits(Engine(path, EngineConfig(num_kv_blocks=16), device=device), prompts)
    for cpu_moe, host_layers in ((1, 1), ("all", 2)):
        engine = Engine(path, EngineConfig(num_kv_blocks=16, cpu_moe=cpu_moe), device=device)
        for layer, experts in engine.model.experts():
            assert experts.mlp.device.type == ("cpu" if layer < host_layers else device.type)
        for ours, expected in zip(all_logits(engine, prompts), reference):
            assert torch.allclose(ours, expected, rtol=1e-2 if device == "cuda" else 1e-5, atol=1e-3)


def test_cpu_moe_option_is_checked() -> None:
    for bad in (-1, "some", 1.5):
        with pytest.raises(LocalserveError, match="cpu_moe"):
            EngineConfig(cpu_moe=bad)  # type: ignore[arg-type]
