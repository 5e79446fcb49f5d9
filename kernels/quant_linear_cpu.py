"""CPU fast path for QuantWeight at decode sizes: a fused dequantize-GEMV in C++
(``csrc/quant_gemv_cpu.cpp``, built with the other CPU kernels by ``cpu_extension``).

Weights with an ``int8_block`` (GGUF's quantized types) take the kernel's integer path:
x rounded to int8 per block of inputs, as llama.cpp does, 1.4-2x as fast at one row as
dequantizing to fp32. LOCALSERVE_EXACT_CPU_MATMUL=1 keeps x in fp32 for every weight."""

from __future__ import annotations

import torch

from . import cpu_extension
from .dispatch import exact_cpu_matmul
from .quant_linear import QuantWeight

# Up to this many rows the fused kernel wins: the weight is read once and never
# materialised. Beyond it, dequantize-then-GEMM amortises the dequantization better
# (measured on a 5632x1024 Q8_0 weight, 2 AVX2 cores: 5.3 ms fused vs 8.1 ms at 32 rows,
# 11.3 vs 10.4 at 64).
MAX_ROWS = 32


def supports(x: torch.Tensor) -> bool:
    """Every QuantWeight layout is handled; what decides is x: fp32 and decode-sized."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    return x.dtype == torch.float32 and 0 < rows <= MAX_ROWS and cpu_extension.available()


def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    offsets = weight.zeros if weight.zeros is not None else weight.mins
    out = cpu_extension.extension().quant_gemv(  # type: ignore[union-attr]
        flat, weight.codes, weight.scales, offsets, weight.mins is not None, weight.bits, weight.group_size,
        weight.super_scales, weight.super_mins, weight.groups_per_super,
        weight.int8_block if uses_int8_activations(weight) else 0)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.out_features)


def uses_int8_activations(weight: QuantWeight) -> bool:
    """Whether x is rounded to int8 for this weight: it has an ``int8_block`` (a multiple
    of 32 that divides K), groups of 16 inputs or of whole 32-input blocks, and no
    LOCALSERVE_EXACT_CPU_MATMUL=1."""
    block, group_size = weight.int8_block, weight.group_size
    return (block > 0 and block % 32 == 0 and weight.in_features % block == 0
            and (group_size == 16 or group_size % 32 == 0) and weight.perm is None and not exact_cpu_matmul())
