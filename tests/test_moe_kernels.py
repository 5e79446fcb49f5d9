"""The MoE kernels' CPU path against the reference (the per-expert loop): dense and
GGUF-quantized experts, fused or separate gate/up, GPTQ act-order per expert, skewed
routings, batches of 1 to 256 tokens. The Triton kernel has test_moe_triton.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from localserve.formats.gguf_quants import gguf_to_weight
from localserve.kernels import cpu_library
from localserve.kernels.experts import ExpertMLP, ExpertWeights, expert_mlp
from localserve.kernels.moe import fused_moe, fused_moe_cpu, route
from localserve.kernels.moe_ref import fused_moe_ref
from localserve.kernels.quant_linear import quant_linear_ref, quantize_activations
from localserve.kernels.quant_weight import QuantWeight
from localserve.kernels.quant_linear_cpu import TiledWeight

E, H, I = 8, 64, 96


def quantized(matrix: torch.Tensor, type_name: str) -> object:
    """A matrix quantized by gguf-py and re-packed by our GGUF reader."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    blocks = gguf.quants.quantize(matrix.numpy(), qtype)
    return gguf_to_weight("w", np.ascontiguousarray(blocks).reshape(-1), int(qtype), tuple(matrix.shape))


def make_experts(gate_type: str, up_type: str, down_type: str, act_order: bool = False, seed: int = 0) -> ExpertMLP:
    generator = torch.Generator().manual_seed(seed)
    projections = []
    for type_name, (rows, cols) in zip((gate_type, up_type, down_type), ((I, H), (I, H), (H, I))):
        dense = torch.randn(E, rows, cols, generator=generator) * cols**-0.5
        if type_name == "F32":
            projections.append(ExpertWeights(dense, E))
            continue
        per_expert = [quantized(w, type_name) for w in dense]
        if act_order:
            per_expert = [replace(w, perm=torch.randperm(cols, generator=generator)) for w in per_expert]
        projections.append(ExpertWeights.stack(per_expert))
    return ExpertMLP.from_projections(*projections)


def routing(tokens: int, top_k: int, kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, E, generator=generator) * 3
    if kind == "one expert takes all":
        logits[:, 5] += 100  # and the second choice varies
    elif kind == "half the experts idle":
        logits[:, 4:] -= 100
    return route(logits, top_k, renormalize=True)


CASES = {
    "dense": ("F32", "F32", "F32", False),
    "Q8_0": ("Q8_0", "Q8_0", "Q8_0", False),
    "Q4_0 gate/up, Q4_1 down": ("Q4_0", "Q4_0", "Q4_1", False),
    "gate and up unlike (not fused)": ("Q4_0", "Q8_0", "Q5_0", False),
    "act-order per expert": ("Q4_0", "Q4_0", "Q4_0", True),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tokens", [1, 2, 7, 33, 256])
@pytest.mark.parametrize("kind", ["random", "one expert takes all", "half the experts idle"])
def test_cpu_path_equals_reference(case: str, tokens: int, kind: str) -> None:
    experts = make_experts(*CASES[case])
    assert len(experts.gate_up) == (2 if case in ("gate and up unlike (not fused)", "act-order per expert") else 1)
    gates, ids = routing(tokens, 2, kind, seed=tokens)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    expected = fused_moe_ref(x, experts, gates, ids)
    ours = fused_moe_cpu(x, experts, gates, ids)
    assert torch.equal(fused_moe(x, experts, gates, ids), ours)  # the dispatcher's choice on CPU
    assert ours.shape == (tokens, H)
    assert ((ours - expected).abs().max() / expected.abs().max()).item() <= 1e-5


def test_unchosen_experts_are_never_read() -> None:
    """Experts no token chose may hold anything (here NaN): they are skipped."""
    experts = make_experts("F32", "F32", "F32")
    gates, ids = routing(16, 2, "half the experts idle", seed=1)
    assert ids.max() < 4
    for projection in (*experts.gate_up, experts.down):
        projection.weight[4:] = float("nan")
    out = fused_moe_cpu(torch.randn(16, H), experts, gates, ids)
    assert torch.isfinite(out).all()


def test_one_token_one_expert_is_that_experts_mlp() -> None:
    """The definition, by hand: top-1 routing with gate 1 is the chosen expert's SwiGLU."""
    experts = make_experts("F32", "F32", "F32")
    x = torch.randn(3, H)
    ids = torch.tensor([[6], [0], [6]])
    gates = torch.ones(3, 1)
    gate_up, down = experts.gate_up[0].weight, experts.down.weight
    for t, e in enumerate(ids[:, 0].tolist()):
        gate, up = (gate_up[e] @ x[t]).split(I)
        expected = down[e] @ (torch.nn.functional.silu(gate) * up)
        torch.testing.assert_close(fused_moe_cpu(x, experts, gates, ids)[t], expected)


def test_route_picks_the_largest_and_renormalises() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    gates, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(gates[0], probs[[1, 2]])
    gates, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(gates[0], probs[[1, 2]] / probs[[1, 2]].sum())


def test_stacking_rejects_unlike_experts() -> None:
    experts = [quantized(torch.randn(I, H), "Q4_0"), quantized(torch.randn(I, H), "Q8_0")]
    with pytest.raises(ValueError):
        ExpertWeights.stack(experts)
    with pytest.raises(ValueError):
        ExpertWeights.stack([torch.randn(I, H), experts[0]])


needs_kernels = pytest.mark.skipif(not cpu_library.available(), reason="the CPU kernels are not built")


def rounded_linear(x: torch.Tensor, weight: object) -> torch.Tensor:
    """The int8 path's definition: x rounded per block as llama.cpp rounds it, then the
    dequantized weight."""
    assert isinstance(weight, QuantWeight)
    return quant_linear_ref(quantize_activations(x, weight.int8_block), weight)


@needs_kernels
@pytest.mark.parametrize("case", ["Q8_0", "Q4_0 gate/up, Q4_1 down", "gate and up unlike (not fused)"])
def test_gguf_experts_run_on_the_int8_kernel(case: str) -> None:
    experts = make_experts(*CASES[case])
    tiled = experts.for_int8_kernel()
    assert all(isinstance(p.weight, TiledWeight) for p in (*tiled.gate_up, tiled.down))
    assert tiled.nbytes > 0 and tiled.num_experts == E and tiled.intermediate_size == I
    # Fused gate_up: every chosen expert in one grouped call per projection; else one by one.
    assert tiled.tiled == (case != "gate and up unlike (not fused)")
    gates, ids = routing(40, 2, "random", seed=3)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(3))
    ours = fused_moe(x, tiled, gates, ids)
    expected = torch.zeros_like(ours)
    for t in range(40):
        for gate, e in zip(gates[t].tolist(), ids[t].tolist()):
            expected[t] += gate * expert_mlp(x[t:t + 1], experts, e, rounded_linear)[0]
    assert ((ours - expected).abs().max() / expected.abs().max()).item() <= 1e-5
    # Not the fp32-activation path: the rounding is there.
    assert not torch.allclose(ours, fused_moe_ref(x, experts, gates, ids), rtol=1e-6, atol=0)
    # Each token's output is the same bits whatever else is in the step.
    for rows in (1, 2, 7, 33):
        assert torch.equal(fused_moe(x[:rows], tiled, gates[:rows], ids[:rows]), ours[:rows])


@needs_kernels
def test_experts_the_int8_kernel_cannot_take_stay_as_they_are() -> None:
    for case in ("dense", "act-order per expert"):
        experts = make_experts(*CASES[case])
        tiled = experts.for_int8_kernel()
        assert all(a.weight is b.weight for a, b in zip((*tiled.gate_up, tiled.down), (*experts.gate_up, experts.down)))
    # Experts whose rows do not start on a tile boundary (a stack of 3 rows each) stay too.
    odd = ExpertWeights.stack([quantized(torch.randn(3, 64), "Q8_0") for _ in range(4)])
    assert odd.for_int8_kernel() is odd
    with pytest.raises(ValueError, match="tiles"):
        experts = make_experts("Q8_0", "Q8_0", "Q8_0").for_int8_kernel()
        experts.down.weight.row_range(3, 64)  # type: ignore[union-attr]
