"""The definition of the MoE MLP (see ``moe.py``): a loop over every expert, each
taking the tokens that chose it, with quantized weights dequantized in full."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .experts import ExpertMLP, expert_mlp
from .quant_linear import quant_linear_ref
from .quant_weight import QuantWeight


def _linear(x: torch.Tensor, weight: torch.Tensor | QuantWeight) -> torch.Tensor:
    return quant_linear_ref(x, weight) if isinstance(weight, QuantWeight) else F.linear(x, weight)


def fused_moe_ref(x: torch.Tensor, experts: ExpertMLP, gates: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for expert in range(experts.num_experts):
        tokens, slot = torch.where(ids == expert)
        if tokens.numel() == 0:
            continue
        y = expert_mlp(x[tokens], experts, expert, _linear)
        out.index_add_(0, tokens, y.float() * gates[tokens, slot].float().unsqueeze(1))
    return out.to(x.dtype)
