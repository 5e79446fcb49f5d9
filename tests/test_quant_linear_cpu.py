"""The compiled CPU matmuls (``kernels/quant_linear_cpu.py``) against the torch reference:
the int8 kernel over tiled GGUF-style weights, the fp32 kernel over every QuantWeight
layout, and batch invariance (a row's result is the same bits at any row count)."""

from __future__ import annotations

import ctypes
import itertools

import pytest
import torch

from localserve.kernels import cpu_library, quant_linear_cpu
from localserve.kernels.dispatch import KernelChoice, using
from localserve.kernels.quant_linear import linear, quant_linear, quant_linear_ref, quantize_activations
from localserve.formats.gguf_iquants import IQ4_VALUES
from localserve.kernels.quant_weight import QuantWeight, dequantize, pack_codes
from localserve.kernels.quant_linear_cpu import (TiledWeight, can_tile, float_linear, grouped_int8_linear, int8_linear,
                                                 tile, weight_table)

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the CPU kernels were not built")


def make_weight(bits: int, group_size: int, form: str, scale_dtype: torch.dtype, zero_dtype: torch.dtype,
                permuted: bool, n: int = 24, k: int = 128) -> QuantWeight:
    """Random codes and factors; ``scale_dtype`` int8 means two-level scales (GGUF
    K-quant style: fp16 super-scales times integer sub-scales, and sub-mins likewise)."""
    generator = torch.Generator().manual_seed(bits * 100 + group_size)
    groups = k // group_size
    codes = torch.randint(0, 1 << bits, (n, k), generator=generator)
    two_level = scale_dtype == torch.int8
    extra: dict = {}
    if two_level:
        per_super = max(1, groups // 2)
        scales = torch.randint(-32, 32, (n, groups), generator=generator).to(torch.int8)
        extra["super_scales"] = (torch.rand(n, groups // per_super, generator=generator) * 0.01).half()
        extra["groups_per_super"] = per_super
        if form == "mins":
            extra["super_mins"] = (torch.rand(n, groups // per_super, generator=generator) * 0.01).half()
    else:
        scales = (torch.rand(n, groups, generator=generator) * 0.1).to(scale_dtype)
    if form == "zeros":
        high = 300 if zero_dtype == torch.int16 else 1 << bits
        extra["zeros"] = torch.randint(0, high, (n, groups), generator=generator).to(zero_dtype)
    elif two_level:
        extra["mins"] = torch.randint(0, 64, (n, groups), generator=generator).to(torch.uint8)
    else:
        extra["mins"] = torch.randn(n, groups, generator=generator)
    perm = torch.randperm(k, generator=generator) if permuted else None
    return QuantWeight(bits, group_size, pack_codes(codes, bits), scales, perm=perm, **extra)


def make_gguf_like(bits: int, group_size: int, form: str, x_block: int, n: int = 40, k: int = 512) -> QuantWeight:
    """A weight as the GGUF reader makes them: one zero point for the whole tensor (or
    mins, or IQ4's 16 levels as a codebook), fp16 scales, two-level (int sub-scales) when
    x_block is 256 as for K-quants and IQ4_XS."""
    generator = torch.Generator().manual_seed(bits * 1000 + group_size * 10 + x_block)
    groups = k // group_size
    two_level = x_block == 256
    extra: dict = {}
    if two_level:
        per_super = x_block // group_size
        scales = torch.randint(-32, 32, (n, groups), generator=generator).to(torch.int8)
        if form == "mins":
            scales = scales.abs().to(torch.uint8)  # Q4_K/Q5_K/Q2_K: unsigned 6-bit sub-scales
            extra["super_mins"] = (torch.rand(n, groups // per_super, generator=generator) * 0.01).half()
            extra["mins"] = torch.randint(0, 64, (n, groups), generator=generator).to(torch.uint8)
        extra["super_scales"] = (torch.rand(n, groups // per_super, generator=generator) * 0.01).half()
        extra["groups_per_super"] = per_super
    else:
        scales = (torch.rand(n, groups, generator=generator) * 0.1).half()
        if form == "mins":
            extra["mins"] = torch.randn(n, groups, generator=generator).half().float()  # -m of Q4_1/Q5_1
    if form == "zeros":
        extra["zeros"] = torch.full((n, groups), 1 << (bits - 1), dtype=torch.uint8)
    if form == "codebook":
        extra["codebook"] = torch.tensor(IQ4_VALUES)
    if form == "eighths":  # values that are integers over 8, as the IQ1/IQ2 codebooks
        extra["codebook"] = torch.tensor(IQ4_VALUES) / 8
    codes = torch.randint(0, 1 << bits, (n, k), generator=generator)
    return QuantWeight(bits, group_size, pack_codes(codes, bits), scales, int8_block=x_block, **extra)


CASES = [
    case
    for case in itertools.product([2, 4, 5, 8], [16, 32, 128], ["zeros", "mins"], [torch.float16, torch.float32, torch.int8],
                                  [torch.uint8, torch.int16], [False, True])
    if not (case[2] == "mins" and case[4] == torch.int16)  # the zero dtype does not apply to mins
]
# Nibbles (2, 4 bits), bytes (5, 6) and full bytes (8); groups of 16 (Q2_K, Q3_K, Q6_K) and
# 32; single-level scales with 32-input x blocks, two-level with 256 (the K-quants).
# Codebook weights: IQ4_XS (two-level) and IQ4_NL / MXFP4 (one level) in the int8 kernel,
# and values in eighths under sub-scales per 16 and 32 (IQ2_XS, IQ1_M; IQ2_XXS, IQ1_S).
GGUF_CASES = [*itertools.product([2, 4, 5, 6, 8], [(16, 256), (32, 256), (32, 32)], ["zeros", "mins"]),
              (4, (32, 256), "codebook"), (4, (32, 32), "codebook"), (4, (16, 256), "eighths"),
              (4, (32, 256), "eighths")]
# Row blocks of the int8 kernel: one to five rows alone, fours then a last block (9 = 4 + 5).
ROW_COUNTS = (1, 2, 3, 5, 9, 16, 64)


def test_the_best_library_for_this_cpu_is_loaded() -> None:
    built = {name for name in cpu_library.VARIANTS if cpu_library.library_path(name).is_file()}
    assert cpu_library.variant() == cpu_library.choose_variant(cpu_library.cpu_flags(), built)


def test_variant_choice_follows_the_cpu_flags() -> None:
    every = set(cpu_library.VARIANTS)
    avx512 = set(cpu_library.VARIANTS["avx512_vnni"])
    assert cpu_library.choose_variant(avx512, every) == "avx512_vnni"
    assert cpu_library.choose_variant(avx512 - {"avx512_vnni"}, every) == "avx2"  # AVX-512 without VNNI
    assert cpu_library.choose_variant({"avx2", "fma", "f16c"}, every) == "avx2"
    assert cpu_library.choose_variant({"sse4_2"}, every) == "generic"
    assert cpu_library.choose_variant({"sse4_2"}, {"avx512_vnni", "avx2"}) is None  # x86 without AVX2: references


@pytest.mark.parametrize("bits,group_size,form,scale_dtype,zero_dtype,permuted", CASES)
def test_float_kernel_equals_reference_and_is_batch_invariant(bits, group_size, form, scale_dtype, zero_dtype,
                                                              permuted) -> None:
    weight = make_weight(bits, group_size, form, scale_dtype, zero_dtype, permuted)
    bias = torch.randn(weight.out_features)
    x = torch.randn(max(ROW_COUNTS), weight.in_features)
    expected = quant_linear_ref(x, weight, bias)
    ours = float_linear(x, weight, bias)
    # Same dequantized values; only the order (and fusing) of the sums differs from the GEMM's.
    assert ((ours - expected).abs().max() / expected.abs().max()).item() <= 1e-5
    for rows in ROW_COUNTS:
        assert torch.equal(float_linear(x[:rows], weight, bias), ours[:rows])


@pytest.mark.parametrize("bits,blocks,form", GGUF_CASES)
def test_int8_kernel_equals_reference_on_rounded_x(bits: int, blocks: tuple[int, int], form: str) -> None:
    """The integer path computes the float path on x rounded per block, and the tiled
    weight holds exactly the values of the QuantWeight it came from."""
    group_size, x_block = blocks
    weight = make_gguf_like(bits, group_size, form, x_block)
    assert can_tile(weight)
    tiled = tile(weight)
    assert torch.equal(tiled.dequantize(), dequantize(weight))
    index = torch.tensor([[39, 0], [17, 17]])
    assert torch.equal(tiled.dequantize_rows(index), dequantize(weight)[index])
    x = torch.randn(20, weight.in_features)  # past 16 rows the K-quants take the widened-panel path
    x[0, :x_block] = 0  # an all-zero block
    x[-1, x_block:2 * x_block] *= 1000  # blocks of very different ranges
    ours = int8_linear(x, tiled)
    rounded = quantize_activations(x, x_block)
    expected = quant_linear_ref(rounded, weight)
    # The sums in another order, zero points met once per group: errors scale with the
    # terms' magnitudes rather than the result's.
    magnitude = rounded.abs() @ dequantize(weight).abs().T
    assert ((ours - expected).abs() <= 1e-5 * magnitude).all()
    # Not the unrounded x, nor x rounded per 32 when the block is larger: the path is taken, with its block.
    assert not torch.allclose(ours, quant_linear_ref(x, weight), rtol=1e-6, atol=0)
    if x_block != 32:
        assert not torch.allclose(ours, quant_linear_ref(quantize_activations(x, 32), weight), rtol=1e-6, atol=0)


@pytest.mark.parametrize("bits,blocks,form", GGUF_CASES)
def test_int8_kernel_is_batch_invariant(bits: int, blocks: tuple[int, int], form: str) -> None:
    """Each row's result is the same bits alone and among 1..63 other rows (every tile
    shape: blocks of one to five rows; tile pairs and a last odd tile)."""
    weight = make_gguf_like(bits, blocks[0], form, blocks[1])
    tiled = tile(weight)
    x = torch.randn(max(ROW_COUNTS), weight.in_features)
    together = int8_linear(x, tiled)
    alone = torch.cat([int8_linear(x[i : i + 1], tiled) for i in range(x.shape[0])])
    assert torch.equal(together, alone)
    for rows in ROW_COUNTS:
        assert torch.equal(int8_linear(x[-rows:], tiled), together[-rows:])


@pytest.mark.parametrize("bits,blocks,form", [(6, (16, 256), "zeros"), (4, (32, 256), "mins"), (8, (32, 32), "zeros"),
                                             (4, (32, 32), "codebook")])
def test_grouped_kernel_gives_each_group_its_weights_result(bits: int, blocks: tuple[int, int], form: str) -> None:
    """Groups of rows through their own weights (the chosen experts of a stack, three
    tiles each: a pair and an odd one) in one call: each group the same bits as its
    rows alone through its weight, in any order, an empty group skipped."""
    stack = tile(make_gguf_like(bits, blocks[0], form, blocks[1], n=4 * 48))
    weights = [stack.row_range(48 * e, 48 * (e + 1)) for e in range(4)]
    table = weight_table(weights)
    ids, counts = [2, 0, 1, 3], [20, 1, 0, 5]  # 20 rows: a K-quant's panel path
    x = torch.randn(26, stack.in_features)
    out = grouped_int8_linear(x, table, ids, counts, 48)
    start = 0
    for e, count in zip(ids, counts):
        assert torch.equal(out[start:start + count], int8_linear(x[start:start + count], weights[e]))
        start += count
    for bad_counts in ([20, 1, 0, 4], [21, -1, 0, 5], [20, 1, 5]):
        with pytest.raises(ValueError, match="make up"):
            grouped_int8_linear(x, table, ids, bad_counts, 48)
    with pytest.raises(IndexError, match="outside the table"):
        grouped_int8_linear(x, table, [2, 0, 1, 4], counts, 48)
    with pytest.raises(ValueError, match="one shape and form"):
        weight_table([weights[0], stack.row_range(0, 32)])


def test_quantize_activations_rounds_to_127_levels_per_block() -> None:
    x = torch.randn(3, 64) * torch.tensor([1.0, 100.0]).repeat_interleave(32)
    rounded = quantize_activations(x)
    for block in range(2):
        part, original = rounded[:, 32 * block: 32 * block + 32], x[:, 32 * block: 32 * block + 32]
        d = original.abs().amax(-1, keepdim=True) / 127
        codes = part / d
        assert torch.allclose(codes, codes.round(), atol=1e-3) and codes.abs().max() <= 127 + 1e-3
        assert ((part - original).abs() <= d / 2 + 1e-6).all()
    assert (quantize_activations(torch.zeros(2, 32)) == 0).all()


def test_other_built_variants_compute_the_same_sums() -> None:
    """Every library built here (AVX2 on an AVX-512 host too) against the reference,
    through its own tile layout; each is batch invariant on its own."""
    flags = cpu_library.cpu_flags()
    runnable = [name for name, needs in cpu_library.VARIANTS.items()
                if cpu_library.library_path(name).is_file() and set(needs) <= flags]
    assert cpu_library.variant() in runnable
    for name in runnable:
        lib = cpu_library.load(name)
        for bits, blocks, form in [(4, (32, 256), "mins"), (8, (32, 32), "zeros"), (6, (16, 256), "zeros"),
                                   (4, (32, 256), "codebook")]:
            weight = make_gguf_like(bits, blocks[0], form, blocks[1])
            tiled = tile(weight, lanes=lib.ls_lanes())
            x = torch.randn(20, weight.in_features)  # K-quants: past 16 rows, the widened-panel path
            out = torch.empty(20, weight.out_features)
            lib.ls_int8_matmul(ctypes.byref(tiled.desc), x.data_ptr(), 20, out.data_ptr())
            rounded = quantize_activations(x, blocks[1])
            magnitude = rounded.abs() @ dequantize(weight).abs().T
            assert ((out - quant_linear_ref(rounded, weight)).abs() <= 1e-5 * magnitude).all(), name
            for start, rows in [(3, 1), (4, 3), (7, 5)]:  # blocks of one, three and five rows
                some = torch.empty(rows, weight.out_features)
                lib.ls_int8_matmul(ctypes.byref(tiled.desc), x[start:start + rows].contiguous().data_ptr(), rows,
                                   some.data_ptr())
                assert torch.equal(some, out[start:start + rows]), name


def test_only_gguf_style_weights_are_tiled() -> None:
    assert can_tile(make_gguf_like(4, 32, "zeros", 32))
    per_group_zeros = make_weight(4, 32, "zeros", torch.float16, torch.uint8, permuted=False)
    per_group_zeros.int8_block = 32
    assert not can_tile(per_group_zeros)  # GPTQ/AWQ zero points differ per group
    permuted = make_gguf_like(4, 32, "zeros", 32)
    permuted.perm = torch.randperm(permuted.in_features)
    assert not can_tile(permuted)
    fp32_scales = make_gguf_like(4, 32, "zeros", 32)
    fp32_scales.scales = fp32_scales.scales.float() + 1e-7
    assert not can_tile(fp32_scales)  # not fp16-exact
    no_block = make_gguf_like(4, 32, "zeros", 32)
    no_block.int8_block = 0
    assert not can_tile(no_block)
    eighths = make_gguf_like(4, 32, "codebook", 32)
    eighths.codebook = eighths.codebook / 8  # a power of two times integers (IQ1's and IQ2's values)
    assert can_tile(eighths) and tile(eighths).level_scale == 1 / 8
    thirds = make_gguf_like(4, 32, "codebook", 32)
    thirds.codebook = thirds.codebook / 3
    assert not can_tile(thirds)
    # Two levels: the kernel sums a super-block of an even number of groups in integers,
    # one super-block per int8 block of x.
    k_quant = make_gguf_like(4, 32, "mins", 256)
    assert can_tile(k_quant) and k_quant.groups_per_super == 8
    odd = make_gguf_like(4, 32, "mins", 256, k=768)
    odd.groups_per_super, odd.int8_block = 3, 96  # super-blocks of three groups
    assert not can_tile(odd)
    super_past_block = make_gguf_like(4, 32, "mins", 256)
    super_past_block.int8_block = 128
    assert not can_tile(super_past_block)


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = make_weight(4, 32, "zeros", torch.float16, torch.uint8, permuted=False)
    calls = []
    monkeypatch.setattr(quant_linear_cpu, "float_linear", lambda *a: calls.append(a) or float_linear(*a))
    x = torch.randn(2, 5, weight.in_features)  # leading dimensions are kept, at any row count
    assert quant_linear(x, weight).shape == (2, 5, weight.out_features) and len(calls) == 1
    tiled = tile(make_gguf_like(4, 32, "zeros", 32))
    assert isinstance(tiled, TiledWeight)
    assert torch.equal(linear(torch.ones(3, 512), tiled), int8_linear(torch.ones(3, 512), tiled))
    with using(KernelChoice(cpu_kernels=False)):  # an engine that keeps the references
        quant_linear(x, weight)
    assert len(calls) == 1


@pytest.mark.parametrize("n,k", [(24, 128), (37, 203), (5, 7)])  # outputs past the blocks of 4, a k tail
def test_dense_kernel_equals_torch_and_is_batch_invariant(n: int, k: int) -> None:
    generator = torch.Generator().manual_seed(n * k)
    weight, bias = torch.randn(n, k, generator=generator), torch.randn(n, generator=generator)
    x = torch.randn(max(ROW_COUNTS), k, generator=generator)
    together = quant_linear_cpu.dense_linear(x, weight, bias)
    magnitude = x.abs() @ weight.abs().T
    assert ((together - torch.nn.functional.linear(x, weight, bias)).abs() <= 1e-6 * magnitude + 1e-6).all()
    for rows in ROW_COUNTS:
        assert torch.equal(quant_linear_cpu.dense_linear(x[-rows:], weight, bias), together[-rows:])
    assert torch.equal(linear(x[:3], weight, bias), together[:3])  # the dispatcher's choice for fp32 on CPU


@pytest.mark.parametrize("type_name", ["IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS",
                                       "IQ1_M", "IQ1_S", "TQ2_0", "TQ1_0"])
def test_every_iq_and_tq_layout_tiles_exactly(type_name: str) -> None:
    """The GGUF reader's own layout of each type goes onto the int8 kernel and holds the
    same values; x meets it rounded per the type's block."""
    gguf = pytest.importorskip("gguf")
    from localserve.formats.gguf_quants import gguf_to_weight

    from .test_gguf_quants import random_blocks

    qtype = gguf.GGMLQuantizationType[type_name]
    shape = (40, 512)
    weight = gguf_to_weight("w", random_blocks(qtype, shape, seed=3), int(qtype), shape)
    assert can_tile(weight)
    tiled = tile(weight)
    assert torch.equal(tiled.dequantize(), dequantize(weight))
    x = torch.randn(5, 512)
    rounded = quantize_activations(x, weight.int8_block)
    magnitude = rounded.abs() @ dequantize(weight).abs().T
    assert ((int8_linear(x, tiled) - quant_linear_ref(rounded, weight)).abs() <= 1e-5 * magnitude).all()
