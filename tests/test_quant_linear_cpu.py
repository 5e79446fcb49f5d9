"""The C++ fused dequantize-GEMV (CPU decode path) against the torch reference."""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch

from localserve.kernels import cpu_extension, quant_linear_cpu
from localserve.kernels.quant_linear import (QuantWeight, dequantize, pack_codes, quant_linear, quant_linear_ref,
                                             quantize_activations)

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


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


CASES = [
    case
    for case in itertools.product([2, 4, 5, 8], [16, 32, 128], ["zeros", "mins"], [torch.float16, torch.float32, torch.int8],
                                  [torch.uint8, torch.int16], [False, True])
    if not (case[2] == "mins" and case[4] == torch.int16)  # the zero dtype does not apply to mins
]


def test_builds() -> None:
    assert cpu_extension.available(), "the C++ extension did not build; see the warning in the log"


@pytest.mark.parametrize("bits,group_size,form,scale_dtype,zero_dtype,permuted", CASES)
def test_fused_equals_reference(bits, group_size, form, scale_dtype, zero_dtype, permuted) -> None:
    weight = make_weight(bits, group_size, form, scale_dtype, zero_dtype, permuted)
    bias = torch.randn(weight.out_features)
    for rows in (1, 3, 13, quant_linear_cpu.MAX_ROWS):  # 13: a block of 8, one of 4, one row
        x = torch.randn(rows, weight.in_features)
        assert quant_linear_cpu.supports(x)
        expected = quant_linear_ref(x, weight, bias)
        ours = quant_linear_cpu.quant_linear(x, weight, bias)
        # Same dequantized values; only the order (and fusing) of the sums differs from the GEMM's.
        assert ((ours - expected).abs().max() / expected.abs().max()).item() <= 1e-5


INT8_CASES = [case for case in CASES if not case[5]]  # every width (nibbles, bytes, 8-bit bytes), 16-input groups too


@pytest.mark.parametrize("x_block", [32, 256])  # llama.cpp's Q8_0/Q8_1 and Q8_K
@pytest.mark.parametrize("bits,group_size,form,scale_dtype,zero_dtype,permuted", INT8_CASES)
def test_int8_activations_equal_reference_on_rounded_x(bits, group_size, form, scale_dtype, zero_dtype, permuted,
                                                       x_block) -> None:
    """The integer path computes exactly the float path on x rounded per block, for codes
    stored as nibbles (2, 4 bits), bytes (5) and full bytes (8: shifted to signed)."""
    weight = make_weight(bits, group_size, form, scale_dtype, zero_dtype, permuted, k=512)
    weight.int8_block = x_block
    assert quant_linear_cpu.uses_int8_activations(weight)
    for rows in (1, 3, 6, quant_linear_cpu.MAX_ROWS):  # 6: a block of 4 and two single rows
        x = torch.randn(rows, weight.in_features)
        x[0, :x_block] = 0  # an all-zero block
        x[-1, x_block:2 * x_block] *= 1000  # blocks of very different ranges
        ours = quant_linear_cpu.quant_linear(x, weight)
        rounded = quantize_activations(x, x_block)
        expected = quant_linear_ref(rounded, weight)
        # The sums in another order, and zero points (up to 300 here) met once per group
        # instead of per input: rounding errors scale with the terms' magnitudes, which
        # a large zero point makes far larger than the result.
        magnitude = rounded.abs() @ dequantize(weight).abs().T
        assert ((ours - expected).abs() <= 1e-5 * magnitude).all()
        # And not the same as the unrounded x, nor as x rounded per 32 when the block is
        # larger: the path is taken, with its block size.
        assert not torch.allclose(ours, quant_linear_ref(x, weight), rtol=1e-6, atol=0)
        if x_block != 32:
            assert not torch.allclose(ours, quant_linear_ref(quantize_activations(x, 32), weight), rtol=1e-6, atol=0)


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


def test_exact_cpu_matmul_keeps_fp32_activations(monkeypatch) -> None:
    weight = make_weight(4, 32, "zeros", torch.float16, torch.uint8, permuted=False, k=128)
    weight.int8_block = 32
    monkeypatch.setenv("LOCALSERVE_EXACT_CPU_MATMUL", "1")
    assert not quant_linear_cpu.uses_int8_activations(weight)
    x = torch.randn(2, 128)
    expected = quant_linear_ref(x, weight)
    ours = quant_linear_cpu.quant_linear(x, weight)
    assert ((ours - expected).abs().max() / expected.abs().max()).item() <= 1e-5


def test_dispatch_uses_fused_kernel_only_for_few_rows(monkeypatch) -> None:
    weight = make_weight(4, 32, "zeros", torch.float16, torch.uint8, permuted=False)
    calls = []
    original = quant_linear_cpu.quant_linear
    monkeypatch.setattr(quant_linear_cpu, "quant_linear", lambda *a: calls.append(a) or original(*a))
    quant_linear(torch.randn(2, weight.in_features), weight)
    quant_linear(torch.randn(quant_linear_cpu.MAX_ROWS + 1, weight.in_features), weight)
    assert len(calls) == 1
    x = torch.randn(2, 5, weight.in_features)  # leading dimensions are kept
    assert quant_linear(x, weight).shape == (2, 5, weight.out_features)


def test_build_folder_is_named_by_the_sources_and_clears_stale_locks(tmp_path, monkeypatch) -> None:
    import os
    from pathlib import Path

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = cpu_extension._build_directory()
    csrc = Path(cpu_extension.__file__).parent / "csrc"
    assert build.parent == tmp_path and sorted(p.name for p in build.iterdir()) == sorted(cpu_extension._SOURCES)
    assert all((build / name).read_bytes() == (csrc / name).read_bytes() for name in cpu_extension._SOURCES)
    assert cpu_extension._build_directory() == build  # the same sources, the same folder

    lock = build / "lock"
    lock.touch()
    cpu_extension._build_directory()
    assert lock.exists(), "a build under way keeps its lock"
    os.utime(lock, (0, 0))  # left by a build killed long ago
    cpu_extension._build_directory()
    assert not lock.exists()
