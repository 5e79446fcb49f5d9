"""A vision tower's matrices as quantized as their file holds them: an mmproj file written
in Q8_0 (or another GGUF type) keeps its linear layers' codes, and they run on the text
model's kernels (kernels/quant_linear.py: the int8 kernel on the CPU, the Triton
dequantize-GEMM on CUDA) instead of being widened to float once at load.

Where that is faster (``runs_quantized``): an image is thousands of patches, so a tower's
matmuls are prefill-shaped, and on a CPU with VNNI dot products the int8 kernel runs them
at about twice float32's rate (2 Zen 4 cores: ~330 GOP/s in a Q8_0 prompt's prefill against
~160 GFLOP/s); with AVX2 alone it is slower than float32's GEMM at a tower's shapes
(0.60-0.76x at SigLIP's, 2 Zen 3 cores), so there the tower is widened at load.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import cpu_library
from ..kernels.quant_linear import linear
from ..kernels.quant_linear_cpu import TiledWeight, for_int8_kernel
from ..kernels.quant_weight import QuantWeight


class QuantizedLinear(nn.Module):
    """``x @ W.T + b`` for a quantized W; in place of the tower's ``nn.Linear``."""

    def __init__(self, weight: QuantWeight | TiledWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight  # not a parameter: the tower's .to() has already run
        self.bias = bias

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def runs_quantized(device: torch.device) -> bool:
    """Whether a tower on ``device`` keeps its quantized matrices: on CUDA (the Triton
    kernel), and on a CPU whose int8 kernel has VNNI's dot products."""
    return device.type == "cuda" or cpu_library.variant() == "avx512_vnni"


def linear_weight_names(model: nn.Module) -> set[str]:
    """The names of the model's ``nn.Linear`` weights: those a quantized file may keep quantized."""
    return {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def keep_quantized(model: nn.Module, weights: dict[str, QuantWeight], device: torch.device) -> None:
    """Each ``nn.Linear`` named in ``weights`` (``<module>.weight``) replaced by a
    QuantizedLinear holding that weight on ``device`` (on the CPU, laid out for the int8
    kernel where it takes the type); the layer's bias is kept as loaded."""
    for name, weight in weights.items():
        parent_name, _, child = name.removesuffix(".weight").rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = getattr(parent, child)
        assert isinstance(layer, nn.Linear), f"{name} is not a linear layer's weight"
        weight = weight.to(device)
        if device.type == "cpu":
            weight = for_int8_kernel(weight)
        bias = None if layer.bias is None else layer.bias.detach()
        setattr(parent, child, QuantizedLinear(weight, bias))
