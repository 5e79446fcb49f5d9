"""Building blocks whose weights may be dense or quantized."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localserve.kernels.quant_linear import linear

from localserve.kernels.quant_weight import QuantWeight, concat_rows, dequantize
from localserve.kernels.quant_linear_cpu import TiledWeight, for_int8_kernel

Weight = torch.Tensor | QuantWeight | TiledWeight


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``; with an ``offset`` (Gemma: 1), ``* (offset + weight)``
    computed in fp32 before the cast back, as Gemma's reference does: ``fold_offset``
    turns the loaded weight into that fp32 gain once."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.offset = offset

    def fold_offset(self) -> None:
        """After loading: weight := fp32 (offset + weight), so no step adds it again."""
        if self.offset:
            self.weight.data = self.weight.data.float() + self.offset
            self.offset = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype != x.dtype:  # a folded fp32 gain: multiply in fp32, then cast back
            return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)
        if x.dtype == torch.float32:  # one fused op instead of six (they dominate a CPU decode step's glue)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 whatever the model dtype, as the reference implementations do.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _can_fuse(weights: list[QuantWeight]) -> bool:
    return all(w.perm is None and w.layout() == weights[0].layout() for w in weights)


class Linear(nn.Module):
    """``x @ W.T (+ b)`` with W dense or quantized.

    A fused projection (Q/K/V, gate/up) is filled by one checkpoint tensor per part;
    ``finalize`` joins the parts into a single matmul when their layouts agree (all
    dense, or quantized alike without act-order) and otherwise keeps one per part.
    """

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.part_sizes = part_sizes
        self.parts: list[Weight | None] = [None] * len(part_sizes)
        self.bias_parts: list[torch.Tensor | None] | None = [None] * len(part_sizes) if bias else None
        self.weights: list[Weight] = []
        self.bias: torch.Tensor | None = None

    @property
    def complete(self) -> bool:
        """Every part (and bias part) filled, and not finalized yet."""
        return (bool(self.parts) and all(p is not None for p in self.parts)
                and (self.bias_parts is None or all(b is not None for b in self.bias_parts)))

    def finalize(self, device: torch.device, dtype: torch.dtype, int8_cpu: bool = True) -> None:
        """Join the parts and move them to ``device``; on the CPU, with ``int8_cpu``, the
        quantized weights the int8 kernel takes are tiled for it (replacing them)."""
        parts = self.parts
        if all(isinstance(p, torch.Tensor) for p in parts):
            self.weights = [torch.cat(parts).to(device, dtype)]  # type: ignore[arg-type]
        elif all(isinstance(p, QuantWeight) for p in parts) and _can_fuse(parts):  # type: ignore[arg-type]
            self.weights = [concat_rows(parts).to(device)]  # type: ignore[arg-type]
        else:
            self.weights = [p.to(device) if isinstance(p, QuantWeight) else p.to(device, dtype) for p in parts]  # type: ignore[union-attr]
        if device.type == "cpu" and int8_cpu:
            self.weights = [for_int8_kernel(w) if isinstance(w, QuantWeight) else w for w in self.weights]
        if self.bias_parts is not None:
            self.bias = torch.cat(self.bias_parts).to(device, dtype)  # type: ignore[arg-type]
        self.parts, self.bias_parts = [], None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.weights) == 1:
            return linear(x, self.weights[0], self.bias)
        out = torch.cat([linear(x, w) for w in self.weights], dim=-1)
        return out if self.bias is None else out + self.bias

    @property
    def nbytes(self) -> int:
        tensors = [*self.weights, *([self.bias] if self.bias is not None else [])]
        return sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes for t in tensors)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# The gate's activation by ModelSpec.hidden_act.
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh}


class MLP(nn.Module):
    """Gated: ``down(act(gate(x)) * up(x))``, gate and up in one matmul; SwiGLU with
    silu, GeGLU with gelu_tanh (Gemma). ``fused``: the checkpoint holds gate and up as one
    tensor (gate rows first), filled as a single part."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False,
                 fused: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up = Linear(hidden_size, [2 * intermediate_size] if fused else [intermediate_size] * 2, bias=bias)
        self.down = Linear(intermediate_size, [hidden_size], bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate_size, dim=-1)
        return self.down(self.act(gate) * up)


class Embedding(Linear):
    """Token embeddings (one part of ``vocab`` rows); also usable as the tied LM head."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(hidden_size, [vocab_size])

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        weight = self.weights[0]
        # Dequantize only the rows asked for: the table stays quantized.
        if isinstance(weight, QuantWeight):
            return dequantize(weight.rows(ids), dtype)
        if isinstance(weight, TiledWeight):
            return weight.dequantize_rows(ids, dtype)
        return F.embedding(ids, weight)
