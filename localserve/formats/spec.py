"""Architecture-neutral hyper-parameters that every checkpoint reader produces."""

from __future__ import annotations

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


@dataclass(slots=True)
class ModelSpec:
    """What models.build needs to lay out a decoder-only transformer."""

    architecture: str  # "llama" (Llama, Mistral), "qwen2", "qwen3"; MoE: "mixtral", "qwen2_moe", "qwen3_moe"
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
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None  # the checkpoint's own dtype name, e.g. "bfloat16"
    # Mixture of experts (num_experts 0: a dense model).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's MLP width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-active expert
    extra: dict[str, Any] = field(default_factory=dict)
