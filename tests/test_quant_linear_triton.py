"""The Triton dequantize-GEMM against the plain-torch ``quant_linear_ref``.

On a CUDA machine the kernel is compiled and run on the GPU; elsewhere it runs on CPU
tensors in the Triton interpreter, so sizes are kept small. The dispatcher in
``quant_linear.py`` only picks Triton for CUDA tensors, hence the direct calls here.
QuantWeights are built directly from random codes, scales and zeros/mins, covering
every layout the loaders produce.
"""

import pytest
import torch

from .conftest import spy_on, triton_or_skip

# conftest.py sets TRITON_INTERPRET=1 on machines without CUDA, before anything
# imports triton (the interpreter must be chosen before the first import).
triton, DEVICE, INTERPRETED = triton_or_skip()
# The GPU proof (scripts/gpu_proof.sh) runs these on the device: `pytest -m gpu`.
pytestmark = pytest.mark.gpu

from localserve.kernels import quant_linear as ql  # noqa: E402
from localserve.kernels import quant_linear_triton  # noqa: E402
from localserve.kernels.quant_linear import quant_linear_ref  # noqa: E402
from localserve.kernels.quant_weight import QuantWeight, pack_codes


# Relative to the largest output: the kernel sums K in a different order than torch.
TOLERANCE = {
    torch.float32: 1e-4,
    # Both round the dequantized weight to fp16 the same way; the rest is the output's
    # fp16 rounding and the summation order.
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}

# The Triton interpreter does not do bfloat16 arithmetic (triton-lang/triton#11584).
BF16_NEEDS_GPU = pytest.mark.skipif(INTERPRETED, reason="Triton interpreter has no bfloat16 tl.dot")


def make_weight(
    n: int,
    k: int,
    *,
    bits: int,
    group_size: int,
    form: str = "zeros",
    scale_dtype: torch.dtype = torch.float16,
    zero_dtype: torch.dtype = torch.uint8,
    perm: bool = False,
    seed: int = 0,
) -> QuantWeight:
    """Random codes of ``bits`` bits; signed scales; zeros anywhere in the code range
    (or, for int16, past 255 as GPTQ's 8-bit zero + 1 can be); fp32 mins."""
    gen = torch.Generator().manual_seed(seed)
    groups = k // group_size
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    scales = ((torch.rand(n, groups, generator=gen) + 0.5) * 0.02).to(scale_dtype)
    scales = torch.where(torch.rand(n, groups, generator=gen) < 0.2, -scales, scales)  # GGUF scales can be negative
    zeros = mins = None
    if form == "zeros":
        top = 300 if zero_dtype == torch.int16 else 1 << bits
        zeros = torch.randint(0, top, (n, groups), generator=gen).to(zero_dtype)
    else:
        mins = torch.randn(n, groups, generator=gen) * 0.05
    order = torch.randperm(k, generator=gen) if perm else None
    weight = QuantWeight(bits=bits, group_size=group_size, codes=pack_codes(codes, bits), scales=scales,
                         zeros=zeros, mins=mins, perm=order)
    return weight.to(DEVICE)


def make_inputs(m: int | tuple[int, ...], n: int, k: int, dtype: torch.dtype, *, bias: bool, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    lead = (m,) if isinstance(m, int) else m
    x = torch.randn(*lead, k, generator=gen).to(dtype).to(DEVICE)
    b = (torch.randn(n, generator=gen) * 0.1).to(dtype).to(DEVICE) if bias else None
    return x, b


def check(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None, **tiles: int) -> None:
    if tiles:
        out = quant_linear_triton._quant_linear(x, weight, bias, **tiles)
    else:
        out = quant_linear_triton.quant_linear(x, weight, bias)
    expected = quant_linear_ref(x, weight, bias)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    tol = TOLERANCE[x.dtype] * expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=TOLERANCE[x.dtype], atol=tol)


# Group sizes with N = 40 (not a multiple of 16 or of the 64-wide default tile); "K" is
# one group spanning all inputs (GPTQ group_size -1), 80 = 5 * 16 not a power of two.
GROUPS = [(16, 64), (32, 96), (64, 128), (128, 256), ("K", 80)]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize(("group_size", "k"), GROUPS, ids=[f"g{g}-k{k}" for g, k in GROUPS])
def test_bits_and_group_sizes(bits: int, group_size: int | str, k: int) -> None:
    group_size = k if group_size == "K" else group_size
    weight = make_weight(40, k, bits=bits, group_size=group_size, seed=bits * 1000 + k)
    x, bias = make_inputs(5, 40, k, torch.float32, bias=True)
    check(x, weight, bias)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16,
                                     pytest.param(torch.bfloat16, marks=BF16_NEEDS_GPU)])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("form", "zero_dtype"), [("zeros", torch.uint8), ("zeros", torch.int16), ("mins", None)],
                         ids=["zeros-u8", "zeros-i16", "mins"])
def test_offset_forms_and_dtypes(
    x_dtype: torch.dtype, scale_dtype: torch.dtype, form: str, zero_dtype: torch.dtype | None
) -> None:
    weight = make_weight(24, 64, bits=4, group_size=32, form=form, scale_dtype=scale_dtype,
                         zero_dtype=zero_dtype or torch.uint8)
    x, bias = make_inputs(5, 24, 64, x_dtype, bias=True)
    check(x, weight, bias)


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("perm", [False, True], ids=["no-perm", "perm"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_rows_perm_and_bias(m: int, perm: bool, bias: bool) -> None:
    weight = make_weight(50, 128, bits=4, group_size=32, perm=perm, seed=m)
    x, b = make_inputs(m, 50, 128, torch.float32, bias=bias)
    check(x, weight, b)


@pytest.mark.parametrize(("bits", "form"), [(3, "mins"), (8, "zeros")])
def test_perm_other_layouts(bits: int, form: str) -> None:
    weight = make_weight(20, 96, bits=bits, group_size=16, form=form, perm=True, seed=7)
    x, bias = make_inputs(33, 20, 96, torch.float16, bias=True)
    check(x, weight, bias)


@pytest.mark.parametrize(
    ("group_size", "block_k"),
    [
        pytest.param(64, 16, id="four-tiles-per-group"),
        pytest.param(16, 64, id="four-groups-per-tile"),
        pytest.param(48, 16, id="three-tiles-per-group"),
    ],
)
def test_small_tiles(group_size: int, block_k: int) -> None:
    """16x16 output tiles: several tiles along M and N with ragged edges in both, and
    both arrangements of groups and K tiles."""
    weight = make_weight(37, 192, bits=4, group_size=group_size, form="zeros", perm=True, seed=group_size)
    x, bias = make_inputs(33, 37, 192, torch.float32, bias=True)
    check(x, weight, bias, block_m=16, block_n=16, block_k=block_k)


def test_leading_dims_and_strided_input() -> None:
    """x of shape [batch, seq, K], and a non-contiguous slice of a wider activation."""
    weight = make_weight(40, 64, bits=5, group_size=32, form="mins")
    x, bias = make_inputs((2, 3), 40, 64, torch.float32, bias=True)
    check(x, weight, bias)
    wide, _ = make_inputs(7, 40, 128, torch.float32, bias=False)
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    check(strided, weight, None)


def test_empty_batch() -> None:
    weight = make_weight(40, 64, bits=4, group_size=32)
    x = torch.empty(0, 64, device=DEVICE)
    assert quant_linear_triton.quant_linear(x, weight).shape == (0, 40)


def test_rejects_bad_tiles() -> None:
    weight = make_weight(16, 96, bits=4, group_size=48)
    x, _ = make_inputs(1, 16, 96, torch.float32, bias=False)
    with pytest.raises(ValueError, match="block_k"):
        quant_linear_triton._quant_linear(x, weight, None, block_m=16, block_n=16, block_k=32)


def test_dispatcher_uses_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """``quant_linear`` routes to the kernel when ``use_triton`` says so (CUDA tensors in
    production; forced here so the lazy import path also runs on CPU)."""
    monkeypatch.setattr(ql, "use_triton", lambda tensor: True)
    calls = spy_on(monkeypatch, quant_linear_triton, "quant_linear")
    weight = make_weight(24, 64, bits=4, group_size=32, perm=True)
    x, bias = make_inputs(3, 24, 64, torch.float32, bias=True)
    out = ql.quant_linear(x, weight, bias)
    assert calls == [1]
    expected = quant_linear_ref(x, weight, bias)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("block_k", [16, 64])
@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_k_quants_two_level_scales(type_name: str, block_k: int) -> None:
    """Real K-quant layouts (fp16 super-scales times integer sub-scales and sub-mins),
    with tiles inside one group (16) and spanning several (64)."""
    gguf = pytest.importorskip("gguf")
    from localserve.formats.gguf_quants import gguf_to_weight

    from .test_gguf_quants import random_blocks

    qtype = gguf.GGMLQuantizationType[type_name]
    shape = (24, 512)
    weight = gguf_to_weight("w", random_blocks(qtype, shape, seed=int(qtype)), int(qtype), shape)
    assert weight.super_scales is not None
    x, _ = make_inputs(3, 24, 512, torch.float32, bias=False)
    check(x, weight.to(DEVICE), None, block_m=16, block_n=16, block_k=block_k)


# Every codebook layout the GGUF reader makes: one-level fp16 scales (IQ4_NL), fp16 x
# integer sub-scales (IQ4_XS), power-of-two scales over e2m1 values (MXFP4), and lattice
# types decoded into per-type codebooks (IQ3_S, IQ2_XXS, IQ1_M).
CODEBOOK_TYPES = ["IQ4_NL", "IQ4_XS", "MXFP4", "IQ3_S", "IQ2_XXS", "IQ1_M"]


@pytest.mark.parametrize("block_k", [16, 64])
@pytest.mark.parametrize("type_name", CODEBOOK_TYPES)
def test_gguf_codebook_types(type_name: str, block_k: int) -> None:
    """Each code is looked up in the weight's codebook before scaling: equal to the
    reference on the reader's own layout, with tiles inside one group and over several."""
    gguf = pytest.importorskip("gguf")
    from localserve.formats.gguf_quants import gguf_to_weight

    from .test_gguf_quants import quantized_floats, random_blocks

    qtype = gguf.GGMLQuantizationType[type_name]
    shape = (24, 512)
    # MXFP4's scale is a bare exponent byte: random bytes would overflow, so gguf-py quantizes.
    raw = quantized_floats(qtype, shape, seed=1) if type_name == "MXFP4" else random_blocks(qtype, shape, seed=2)
    weight = gguf_to_weight("w", raw, int(qtype), shape)
    assert weight.codebook is not None and quant_linear_triton.supports(weight)
    x, bias = make_inputs(3, 24, 512, torch.float32, bias=True)
    check(x, weight.to(DEVICE), bias, block_m=16, block_n=16, block_k=block_k)
    # The random scales reach 1e1 and the levels 127: x is made small so fp16 sums stay finite.
    x16 = make_inputs(5, 24, 512, torch.float16, bias=False)[0] / 1024
    check(x16, weight.to(DEVICE), None)
