"""The Triton fused MoE against the per-expert loop ``moe_ref.fused_moe_ref``.

On a CUDA machine the kernel is compiled and run on the GPU; elsewhere it runs on CPU
tensors in the Triton interpreter, so shapes are small (hidden 64, a few experts). The
dispatcher in ``moe.py`` only picks Triton for CUDA tensors, hence the direct calls.
Expert weights are stacked from per-expert QuantWeights of each layout the loaders
produce (GPTQ/AWQ, Q8_0, K-quants with two-level scales, act-order).
"""

from dataclasses import replace

import pytest
import torch

from .conftest import spy_on, triton_or_skip

# conftest.py sets TRITON_INTERPRET=1 on machines without CUDA, before anything
# imports triton (the interpreter must be chosen before the first import).
triton, DEVICE, INTERPRETED = triton_or_skip()
# The GPU proof (scripts/gpu_proof.sh) runs these on the device: `pytest -m gpu`.
pytestmark = pytest.mark.gpu

from localserve.kernels import moe  # noqa: E402
from localserve.kernels import moe_triton  # noqa: E402
from localserve.kernels.experts import ExpertMLP, ExpertWeights  # noqa: E402
from localserve.kernels.moe_ref import fused_moe_ref  # noqa: E402
from localserve.formats.gguf_iquants import IQ4_VALUES  # noqa: E402
from localserve.kernels.quant_weight import QuantWeight, pack_codes  # noqa: E402

# Relative to the largest output: the kernel sums in another order than torch.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2}

# name: (bits, group_size, form, groups_per_super or None)
LAYOUTS = {
    "gptq4": (4, 32, "zeros", None),  # GPTQ/AWQ: fp16 scales, 4-bit zeros
    "q8_0": (8, 32, "zeros", None),  # Q8_0: zero point 128
    "q4_k": (4, 32, "mins", 8),  # Q4_K: 6-bit sub-scales and sub-mins under fp16 super-scales
    "q6_k": (6, 16, "zeros", 16),  # Q6_K: int8 sub-scales, zero point 32
    "iq4_nl": (4, 32, "codebook", None),  # IQ4_NL: fp16 scales over a 16-value codebook
    "iq4_xs": (4, 32, "codebook", 8),  # IQ4_XS: the same codebook under fp16 x int8 sub-scales
}
# The codebook of the IQ4 types (GGUF's kvalues_iq4nl).
IQ4_CODEBOOK = torch.tensor(IQ4_VALUES, dtype=torch.float32)


def make_quant(n: int, k: int, layout: str, gen: torch.Generator, perm: bool = False) -> QuantWeight:
    """One expert's ``[n, k]`` QuantWeight. Two-level layouts keep their format's groups
    per super-block when ``k`` holds two or more super-blocks, else fewer, so that every
    row has at least two (which super-block a group belongs to is then tested)."""
    bits, group, form, per_super = LAYOUTS[layout]
    groups = k // group
    codes = pack_codes(torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8), bits)
    fields: dict = {"codebook": IQ4_CODEBOOK} if form == "codebook" else {}
    if per_super is None:
        scales = ((torch.rand(n, groups, generator=gen) + 0.5) * 0.05).to(torch.float16)
        fields["scales"] = torch.where(torch.rand(n, groups, generator=gen) < 0.2, -scales, scales)
        if form == "codebook":
            fields["scales"] = fields["scales"] * 0.02  # the levels reach 127
        elif layout == "q8_0":
            fields["zeros"] = torch.full((n, groups), 128, dtype=torch.uint8)
        else:
            fields["zeros"] = torch.randint(0, 1 << bits, (n, groups), generator=gen, dtype=torch.uint8)
    else:
        per_super = max(1, min(per_super, groups // 2))
        supers = groups // per_super
        fields["groups_per_super"] = per_super
        fields["super_scales"] = ((torch.rand(n, supers, generator=gen) + 0.5) * 0.01).to(torch.float16)
        if form == "mins":
            fields["scales"] = torch.randint(0, 64, (n, groups), generator=gen, dtype=torch.uint8)
            fields["mins"] = torch.randint(0, 64, (n, groups), generator=gen, dtype=torch.uint8)
            fields["super_mins"] = ((torch.rand(n, supers, generator=gen) + 0.5) * 0.002).to(torch.float16)
        elif form == "codebook":
            fields["scales"] = torch.randint(-32, 32, (n, groups), generator=gen, dtype=torch.int8)
            fields["super_scales"] = fields["super_scales"] * 0.05
        else:
            fields["scales"] = torch.randint(-128, 128, (n, groups), generator=gen, dtype=torch.int8)
            fields["zeros"] = torch.full((n, groups), 32, dtype=torch.uint8)
    order = torch.randperm(k, generator=gen) if perm else None
    return QuantWeight(bits=bits, group_size=group, codes=codes, perm=order, **fields)


def make_experts(num_experts: int, hidden: int, inter: int, kind: str | tuple[str, str, str], *,
                 dtype: torch.dtype = torch.float32, perm: bool = False, seed: int = 0) -> ExpertMLP:
    """Gate, up and down of every expert: ``kind`` "dense" or a layout name, or one per
    projection; ``perm`` gives every quantized projection of every expert its own
    act-order (gate and up then cannot fuse)."""
    gen = torch.Generator().manual_seed(seed)
    kinds = (kind,) * 3 if isinstance(kind, str) else kind
    projections = []
    for proj_kind, (n, k) in zip(kinds, [(inter, hidden), (inter, hidden), (hidden, inter)]):
        if proj_kind == "dense":
            weights = [(torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype) for _ in range(num_experts)]
        else:
            weights = [make_quant(n, k, proj_kind, gen, perm) for _ in range(num_experts)]
        projections.append(ExpertWeights.stack(weights))
    return ExpertMLP.from_projections(*projections).to(DEVICE)


def make_routing(num_tokens: int, num_experts: int, top_k: int, routing: str, seed: int = 1):
    """Gates ``[T, k]`` fp32 and distinct expert ids ``[T, k]``:
    "random" (softmax top-k of random logits), "same" (every token to the same
    experts), "unused" (only three experts ever chosen)."""
    gen = torch.Generator().manual_seed(seed)
    if routing == "random":
        gates, ids = moe.route(torch.randn(num_tokens, num_experts, generator=gen), top_k, renormalize=True)
        return gates.to(DEVICE), ids.to(DEVICE)
    if routing == "same":
        ids = torch.tensor([num_experts - 1, 0, 2][:top_k]).repeat(num_tokens, 1)
    else:
        pool = torch.tensor([1, num_experts - 1, 2])
        ids = torch.stack([pool[torch.randperm(3, generator=gen)[:top_k]] for _ in range(num_tokens)])
    gates = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    return gates.to(DEVICE), ids.to(DEVICE)


def check(num_tokens: int, experts: ExpertMLP, *, dtype: torch.dtype = torch.float32, routing: str = "random",
          top_k: int = 2, tiles: dict | None = None, seed: int = 2) -> None:
    hidden = experts.down.out_features
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    gates, ids = make_routing(num_tokens, experts.num_experts, top_k, routing, seed)
    if tiles:
        out = moe_triton._fused_moe(x, experts, gates, ids, **tiles)
    else:
        out = moe_triton.fused_moe(x, experts, gates, ids)
    expected = fused_moe_ref(x, experts, gates, ids)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol * expected.float().abs().max().item())


@pytest.mark.parametrize("kind", ["dense", "q8_0"])
def test_biased_experts_with_clamped_swiglu_equal_the_reference(kind: str) -> None:
    """GPT-OSS's experts: biases on gate/up (added before the clamped activation) and on
    down (added per pair, then weighted by the gate)."""
    from localserve.kernels.experts import GatedActivation

    experts = make_experts(4, 64, 32, kind)
    gen = torch.Generator().manual_seed(7)
    activation = GatedActivation(alpha=1.702, limit=0.5, up_offset=1.0)  # a limit the random activations exceed
    experts = replace(experts, gate_up_bias=torch.randn(4, 64, generator=gen).to(DEVICE),
                      down_bias=torch.randn(4, 64, generator=gen).to(DEVICE), activation=activation)
    check(9, experts)
    plain = fused_moe_ref(torch.ones(3, 64, device=DEVICE), replace(experts, down_bias=None), *make_routing(3, 4, 2,
                                                                                                            "random"))
    assert not torch.allclose(plain, fused_moe_ref(torch.ones(3, 64, device=DEVICE), experts,
                                                   *make_routing(3, 4, 2, "random")))


# --------------------------------------------------------------------------------------
# align_by_expert
# --------------------------------------------------------------------------------------


# (T, E, k, block_m): decode, small and large batches, more experts than pairs.
ALIGN_CASES = [(1, 8, 2, 16), (7, 4, 2, 16), (33, 8, 3, 16), (33, 6, 2, 64), (256, 8, 2, 64), (5, 64, 1, 16)]


@pytest.mark.parametrize("routing", ["random", "same", "unused"])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "block_m"), ALIGN_CASES)
def test_align_by_expert(num_tokens: int, num_experts: int, top_k: int, block_m: int, routing: str) -> None:
    _, ids = make_routing(num_tokens, num_experts, top_k, routing)
    sorted_pairs, block_experts, num_padded = moe_triton.align_by_expert(ids, num_experts, block_m)
    num_pairs = ids.numel()
    assert sorted_pairs.numel() % block_m == 0 and block_experts.numel() == sorted_pairs.numel() // block_m
    assert sorted_pairs.numel() <= num_pairs + num_experts * (block_m - 1) + block_m - 1
    sorted_pairs, block_experts, flat = sorted_pairs.cpu(), block_experts.cpu(), ids.reshape(-1).cpu()

    counts = torch.bincount(flat, minlength=num_experts)
    padded = ((counts + block_m - 1) // block_m * block_m).sum().item()
    assert num_padded.tolist() == [padded]
    # Every pair exactly once; sentinels (T*k) fill the rest, including all past the total.
    real = sorted_pairs[sorted_pairs != num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    assert (sorted_pairs[padded:] == num_pairs).all()
    # Each block belongs to one expert and holds only its pairs; blocks past the total exit.
    slot_expert = block_experts.repeat_interleave(block_m)
    assert (block_experts[padded // block_m:] == moe_triton.EXIT_EXPERT).all()
    assert (block_experts[: padded // block_m] >= 0).all()
    is_pair = sorted_pairs != num_pairs
    assert torch.equal(flat[sorted_pairs[is_pair].long()], slot_expert[is_pair].long())
    # Each chosen expert: one contiguous, block-aligned run of ceil(count / block_m)
    # blocks, its pairs first and in token order; unchosen experts get no block.
    for e in range(num_experts):
        blocks = (block_experts == e).nonzero().flatten()
        assert blocks.numel() == (counts[e].item() + block_m - 1) // block_m
        if blocks.numel() == 0:
            continue
        assert torch.equal(blocks, torch.arange(blocks[0].item(), blocks[0].item() + blocks.numel()))
        run = sorted_pairs[blocks[0] * block_m:(blocks[-1] + 1) * block_m]
        count = counts[e].item()
        assert torch.equal(run[:count], (flat == e).nonzero().flatten().to(run.dtype))
        assert (run[count:] == num_pairs).all()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="host synchronisation is a CUDA matter")
def test_align_by_expert_does_not_synchronise() -> None:
    """No device-to-host copy (so the alignment can be captured in a CUDA graph)."""
    _, ids = make_routing(33, 8, 2, "random")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_triton.align_by_expert(ids, 8, 16)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --------------------------------------------------------------------------------------
# fused_moe
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 2, 7, 33])
def test_dense(num_tokens: int, dtype: torch.dtype) -> None:
    check(num_tokens, make_experts(4, 64, 32, "dense", dtype=dtype), dtype=dtype)


def test_dense_large_batch() -> None:
    """256 tokens over 8 experts: 64-row blocks, several per expert."""
    experts = make_experts(8, 64, 32, "dense")
    assert moe_triton._choose_block_m(256 * 2, 8) == 64
    check(256, experts)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("num_tokens", [2, 33])
def test_quantized(layout: str, num_tokens: int) -> None:
    """Each layout on gate_up (hidden 512: two K-quant super-blocks of 256 inputs) and
    down (intermediate 64: two super-blocks of fewer groups)."""
    experts = make_experts(4, 512, 64, layout, seed=num_tokens)
    if layout in ("q4_k", "q6_k", "iq4_xs"):
        assert experts.gate_up[0].weight.groups_per_super == LAYOUTS[layout][3]
        assert experts.gate_up[0].weight.super_scales.shape[1] == 2 == experts.down.weight.super_scales.shape[1]
    assert len(experts.gate_up) == 1 and experts.quantized
    check(num_tokens, experts)


def test_quantized_fp16() -> None:
    check(7, make_experts(4, 64, 64, "gptq4"), dtype=torch.float16)


@pytest.mark.parametrize("num_tokens", [1, 33])
def test_unfused_gate_up(num_tokens: int) -> None:
    """Gate 4-bit and up 8-bit cannot share a QuantWeight: two first-GEMM launches
    into the two halves of the intermediate buffer."""
    experts = make_experts(6, 64, 32, ("gptq4", "q8_0", "gptq4"))
    assert len(experts.gate_up) == 2
    check(num_tokens, experts)


@pytest.mark.parametrize("num_tokens", [2, 33])
def test_act_order(num_tokens: int) -> None:
    """GPTQ act-order: a different permutation per expert and per projection (so gate
    and up stay apart too)."""
    experts = make_experts(4, 64, 64, "gptq4", perm=True, seed=3)
    assert experts.down.perms is not None and len(experts.gate_up) == 2
    assert all(p.perms is not None for p in experts.gate_up)
    check(num_tokens, experts)


def test_act_order_fused() -> None:
    """Gate and up sharing each expert's act-order fuse into one gate_up with perms."""
    gen = torch.Generator().manual_seed(4)
    perms = [torch.randperm(64, generator=gen) for _ in range(4)]

    def stack(n: int, k: int, expert_perms: list) -> ExpertWeights:
        weights = [make_quant(n, k, "gptq4", gen) for _ in range(4)]
        return ExpertWeights.stack([replace(w, perm=p) for w, p in zip(weights, expert_perms)])

    experts = ExpertMLP.from_projections(stack(32, 64, perms), stack(32, 64, perms), stack(64, 32, [None] * 4))
    assert len(experts.gate_up) == 1 and experts.gate_up[0].perms is not None and experts.down.perms is None
    check(7, experts.to(DEVICE))


@pytest.mark.parametrize("routing", ["same", "unused"])
@pytest.mark.parametrize("kind", ["dense", "gptq4"])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_skewed_routing(num_tokens: int, kind: str, routing: str) -> None:
    """Every token to the same two experts (one long run), or only three of eight
    experts ever chosen (the rest get no blocks)."""
    check(num_tokens, make_experts(8, 64, 32, kind), routing=routing)


@pytest.mark.parametrize("top_k", [1, 3])
def test_top_k(top_k: int) -> None:
    check(7, make_experts(4, 64, 32, "dense"), top_k=top_k)


@pytest.mark.parametrize(
    ("kind", "inter", "block_k"),
    [
        pytest.param("dense", 40, 16, id="dense-ragged-n"),
        pytest.param("q6_k", 48, 16, id="q6k-one-group-per-tile"),
        pytest.param("q6_k", 64, 32, id="q6k-two-groups-per-tile"),
    ],
)
def test_small_tiles(kind: str, inter: int, block_k: int) -> None:
    """16x16 output tiles: several blocks per expert and several column tiles, with
    ragged column edges (2I = 80 or 96, H = 64 by 16), and both group/tile arrangements."""
    experts = make_experts(4, 64, inter, kind)
    check(33, experts, tiles=dict(block_m=16, block_n=16, block_k=block_k))


def test_dense_ragged_k() -> None:
    """Hidden 72 and intermediate 40: no power of two >= 16 divides K, so the last K
    tile is masked. x and the weights are views into wider tensors whose extra columns
    are NaN, so an unmasked load past K (in either operand) poisons the output."""
    gen = torch.Generator().manual_seed(5)
    hidden, inter, experts = 72, 40, 4

    def nan_padded(*shape: int) -> torch.Tensor:
        wide = torch.full((*shape[:-1], shape[-1] + 16), float("nan"), device=DEVICE)
        wide[..., : shape[-1]] = torch.randn(*shape, generator=gen).to(DEVICE) * shape[-1] ** -0.5
        return wide[..., : shape[-1]]

    mlp = ExpertMLP([ExpertWeights(nan_padded(experts, 2 * inter, hidden), experts)],
                    ExpertWeights(nan_padded(experts, hidden, inter), experts))
    x = nan_padded(7, hidden)
    gates, ids = make_routing(7, experts, 2, "random")
    out = moe_triton.fused_moe(x, mlp, gates, ids)
    expected = fused_moe_ref(x, mlp, gates, ids)
    assert expected.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_strided_input() -> None:
    experts = make_experts(4, 64, 32, "dense")
    gates, ids = make_routing(5, 4, 2, "random")
    wide = torch.randn(5, 128).to(DEVICE)
    x = wide[:, ::2]
    torch.testing.assert_close(moe_triton.fused_moe(x, experts, gates, ids), fused_moe_ref(x, experts, gates, ids),
                               rtol=1e-5, atol=1e-5)


def test_empty_batch() -> None:
    experts = make_experts(4, 64, 32, "dense")
    gates, ids = make_routing(0, 4, 2, "random")
    assert moe_triton.fused_moe(torch.empty(0, 64, device=DEVICE), experts, gates, ids).shape == (0, 64)


def test_supports() -> None:
    assert moe_triton.supports(make_experts(2, 64, 32, "dense"))
    assert moe_triton.supports(make_experts(2, 64, 32, "q6_k"))
    assert moe_triton.supports(make_experts(2, 64, 32, "iq4_xs"))
    gen = torch.Generator().manual_seed(0)
    odd = make_quant(32, 64, "gptq4", gen)
    odd = replace(odd, group_size=8, scales=odd.scales.repeat_interleave(4, 1), zeros=odd.zeros.repeat_interleave(4, 1))
    dense = make_experts(2, 64, 32, "dense")
    assert not moe_triton.supports(ExpertMLP(dense.gate_up, ExpertWeights.stack([odd, odd])))


def test_rejects_bad_tiles() -> None:
    experts = make_experts(2, 64, 32, "gptq4")
    gates, ids = make_routing(3, 2, 1, "random")
    x = torch.randn(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="block_m"):
        moe_triton._fused_moe(x, experts, gates, ids, block_m=24, block_n=16, block_k=None)
    with pytest.raises(ValueError, match="block_k"):  # 128 does not tile K = 64
        moe_triton._fused_moe(x, experts, gates, ids, block_m=16, block_n=16, block_k=128)


def test_dispatcher_uses_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """``moe.fused_moe`` routes to the kernel when ``use_triton`` says so (CUDA tensors
    in production; forced here so the lazy import path also runs on CPU)."""
    monkeypatch.setattr(moe, "use_triton", lambda tensor: True)
    calls = spy_on(monkeypatch, moe_triton, "fused_moe")
    experts = make_experts(4, 64, 32, "gptq4")
    gates, ids = make_routing(3, 4, 2, "random")
    x = torch.randn(3, 64, device=DEVICE)
    out = moe.fused_moe(x, experts, gates, ids)
    assert calls == [1]
    expected = fused_moe_ref(x, experts, gates, ids)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
