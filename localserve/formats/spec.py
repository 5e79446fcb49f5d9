"""Architecture-neutral hyper-parameters that every checkpoint reader produces."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RopeSpec:
    """Rotary embedding settings. ``kind``: default, linear, llama3 or yarn."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    # llama3 and yarn: the context length the model was pre-trained at.
    original_max_position: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: cos/sin scale; None = derived from factor
    partial_rotary_factor: float = 1.0
    # GGUF's rope_freqs tensor: each pair's frequency is divided by its factor.
    freq_factors: tuple[float, ...] | None = None


# What a checkpoint may declare: far above any real model (the largest have ~160 layers,
# hidden 25,600, vocabularies of 262,144 and 256 experts), so that an absurd value is
# refused before anything is sized or counted by it.
_CEILINGS = {
    "num_layers": 4096, "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "num_heads": 4096,
    "num_kv_heads": 4096, "head_dim": 4096, "vocab_size": 1 << 23, "max_position_embeddings": 1 << 30,
    "num_experts": 4096, "moe_intermediate_size": 1 << 20, "shared_expert_intermediate_size": 1 << 20,
}
_POSITIVE = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
             "max_position_embeddings")


@dataclass(slots=True)
class ModelSpec:
    """What models.build needs to lay out a decoder-only transformer."""

    architecture: str  # a key of formats/architectures.py: llama, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (Qwen3)
    sliding_window: int | None = None  # tokens a sliding-window layer attends back over (itself included)
    full_attention_layers: tuple[int, ...] = ()  # with a sliding window: the layers that attend to everything
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None  # the checkpoint's own dtype name, e.g. "bfloat16"
    # Mixture of experts (num_experts 0: a dense model).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's MLP width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-active expert
    norm_topk_prob: bool = True  # rescale the chosen experts' gates to sum to 1
    dense_mlp_layers: tuple[int, ...] = ()  # MoE models: layers with a dense MLP instead
    extra: dict[str, Any] = field(default_factory=dict)

    def window_of(self, layer: int) -> int | None:
        """The sliding window layer ``layer`` attends within, or None for full attention."""
        return None if layer in self.full_attention_layers else self.sliding_window

    def check(self, names: Mapping[str, str]) -> str | None:
        """What is wrong with the declared sizes, or None; ``names`` says what the file
        calls each field, for the message."""

        def said(name: str) -> str:
            return f"{names.get(name, name)} {getattr(self, name):,}"

        for name, ceiling in _CEILINGS.items():
            low = 1 if name in _POSITIVE else 0
            if not low <= getattr(self, name) <= ceiling:
                return f"{said(name)} is outside {low}..{ceiling:,}"
        if self.sliding_window is not None and not 1 <= self.sliding_window <= _CEILINGS["max_position_embeddings"]:
            return f"{said('sliding_window')} is outside 1..{_CEILINGS['max_position_embeddings']:,}"
        if self.num_heads % self.num_kv_heads:
            return f"{said('num_heads')} is not a multiple of {said('num_kv_heads')}"
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            return f"{said('num_experts_per_tok')} of {said('num_experts')} is not a valid routing"
        if self.num_experts and self.moe_intermediate_size <= 0:
            return f"{said('moe_intermediate_size')}: the experts' width must be positive"
        return None

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    def parameter_counts(self) -> ParameterCounts:
        """Parameters in all and those one token runs through (every expert counts in
        the total; only the ``num_experts_per_tok`` it is routed to in the active)."""
        hidden, heads, kv_heads, head_dim = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        q, kv = heads * head_dim, kv_heads * head_dim
        attention = hidden * (q + 2 * kv) + q * hidden + (q + 2 * kv if self.attention_bias else 0)
        attention += 2 * head_dim if self.qk_norm else 0
        norms = 2 * hidden
        total = active = self.vocab_size * hidden * (1 if self.tie_word_embeddings else 2) + hidden
        for layer in range(self.num_layers):
            total += attention + norms
            active += attention + norms
            if not self.is_moe_layer(layer):
                total += 3 * hidden * self.intermediate_size
                active += 3 * hidden * self.intermediate_size
                continue
            expert = 3 * hidden * self.moe_intermediate_size
            always = self.num_experts * hidden  # the router
            if self.shared_expert_intermediate_size:
                always += 3 * hidden * self.shared_expert_intermediate_size + hidden  # and its gate
            total += always + self.num_experts * expert
            active += always + self.num_experts_per_tok * expert
        return ParameterCounts(total, active)


@dataclass(slots=True, frozen=True)
class ParameterCounts:
    total: int
    active: int  # per token
