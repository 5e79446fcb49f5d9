"""The sparse MoE block of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and GPT-OSS: a router
picks each token's top-k experts, the fused MoE kernel runs them, and Qwen2-MoE adds an
always-active shared expert scaled by a sigmoid gate. GPT-OSS's router and experts have
biases and its experts a clamped SwiGLU."""

from __future__ import annotations

import torch
from torch import nn

from localserve.errors import LocalserveError
from localserve.formats.layout import PROJECTIONS
from localserve.formats.spec import ModelSpec
from localserve.kernels.experts import SWIGLU, ExpertMLP, ExpertWeights, GatedActivation
from localserve.kernels.moe import fused_moe, route
from localserve.kernels.quant_weight import QuantWeight

from .layers import MLP, Linear, Weight


class Experts(nn.Module):
    """Every expert of one layer. Filled from the checkpoint one expert at a time
    (``parts[(projection, e)]``, HF and GPTQ/AWQ files) or one projection at a time
    for all experts (``parts[(projection, None)]``, GGUF's stacked ``*_exps``
    tensors, rows expert after expert); ``finalize`` stacks them into an ExpertMLP."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False,
                 activation: GatedActivation = SWIGLU) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.parts: dict[tuple[str, int | None], Weight] = {}
        # Stacked biases [E, rows] by (projection, None), when the experts have them.
        self.bias_parts: dict[tuple[str, int | None], torch.Tensor] | None = {} if bias else None
        self.activation = activation
        self.mlp: ExpertMLP | None = None

    def _matrix(self, projection: str) -> tuple[int, int]:
        if projection == "down":
            return self.hidden_size, self.intermediate_size
        return self.intermediate_size, self.hidden_size

    def _stacked(self, projection: str) -> ExpertWeights:
        whole = self.parts.get((projection, None))
        if whole is not None:
            if isinstance(whole, QuantWeight):
                return ExpertWeights(whole, self.num_experts)
            return ExpertWeights(whole.view(self.num_experts, *self._matrix(projection)), self.num_experts)
        try:
            return ExpertWeights.stack([self.parts[(projection, e)] for e in range(self.num_experts)])
        except ValueError as exc:  # experts quantized unlike each other
            raise LocalserveError(f"experts' {projection} projections cannot be stacked: {exc}") from exc

    def finalize(self, device: torch.device, dtype: torch.dtype, int8_cpu: bool = True) -> None:
        """Stack the experts on ``device``; on the CPU, with ``int8_cpu``, the projections
        the int8 kernel takes are tiled for it, as ``Linear.finalize`` does."""
        gate, up, down = (self._stacked(p) for p in PROJECTIONS)
        biases = None if self.bias_parts is None else tuple(self.bias_parts[(p, None)] for p in PROJECTIONS)
        self.parts, self.bias_parts = {}, None
        self.mlp = ExpertMLP.from_projections(gate, up, down, biases, self.activation).to(device, dtype)
        if device.type == "cpu" and int8_cpu:
            self.mlp = self.mlp.for_int8_kernel()

    @property
    def nbytes(self) -> int:
        return self.mlp.nbytes if self.mlp is not None else 0


class SparseMoE(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        hidden = spec.hidden_size
        self.top_k = spec.num_experts_per_tok
        self.renormalize = spec.norm_topk_prob
        self.router = Linear(hidden, [spec.num_experts], bias=spec.expert_bias)
        activation = SWIGLU
        if spec.clamped_swiglu is not None:
            alpha, limit = spec.clamped_swiglu
            activation = GatedActivation(alpha=alpha, limit=limit, up_offset=1.0)
        self.experts = Experts(spec.num_experts, hidden, spec.moe_intermediate_size, spec.expert_bias, activation)
        shared = spec.shared_expert_intermediate_size
        self.shared_expert = MLP(hidden, shared) if shared else None
        self.shared_expert_gate = Linear(hidden, [1]) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates, ids = route(self.router(x), self.top_k, self.renormalize)
        assert self.experts.mlp is not None, "finalize() loads the experts"
        out = fused_moe(x, self.experts.mlp, gates, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
