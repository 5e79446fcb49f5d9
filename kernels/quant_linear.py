"""The linear layer over dense, quantized and CPU-tiled weights: the dispatchers and
the torch reference.

Which kernel runs is the engine's choice (dispatch.py): the Triton dequantize-GEMM on
CUDA, the C++ kernels on the CPU, else the reference, which dequantizes then multiplies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import quant_linear_cpu
from .dispatch import use_cpu_kernels, use_triton
from .quant_linear_cpu import TiledWeight
from .quant_weight import QuantWeight, dequantize


def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a QuantWeight: the Triton dequantize-GEMM on CUDA when
    it supports the layout, the fused C++ kernel (fp32 x) on CPU, else the torch reference."""
    if use_triton(x):
        from . import quant_linear_triton

        if quant_linear_triton.supports(weight):
            return quant_linear_triton.quant_linear(x, weight, bias)
    elif use_cpu_kernels(x) and quant_linear_cpu.supports(weight):
        return quant_linear_cpu.float_linear(x, weight, bias)
    return quant_linear_ref(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantWeight | TiledWeight, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a dense, quantized or CPU-tiled weight."""
    if isinstance(weight, torch.Tensor):
        # The C++ kernel is batch invariant, unlike a BLAS GEMM.
        if weight.dtype == x.dtype == torch.float32 and use_cpu_kernels(x) and quant_linear_cpu.supports_dense(weight):
            return quant_linear_cpu.dense_linear(x, weight, bias)
        return F.linear(x, weight, bias)
    if isinstance(weight, QuantWeight):
        return quant_linear(x, weight, bias)
    return quant_linear_cpu.int8_linear(x, weight, bias)


def quantize_activations(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x rounded as the int8-activation path rounds it: per block of ``block`` inputs,
    ``round(x / d) * d`` with ``d = max|x| / 127`` (0 for an all-zero block)."""
    blocks = x.reshape(*x.shape[:-1], -1, block)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d == 0, 0.0, torch.round(blocks / d))
    return (q * d).reshape(x.shape)


def quant_linear_ref(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a QuantWeight; the reference dequantizes then multiplies."""
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm)
    return F.linear(x, dequantize(weight, x.dtype), bias)
