"""Architecture-neutral hyper-parameters that every checkpoint reader produces."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .architectures import ARCHITECTURES


@dataclass(slots=True)
class RopeSpec:
    """Rotary embedding settings. ``kind``: default, linear, llama3, yarn, dynamic (NTK) or
    longrope (Phi-3)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    # llama3, yarn, dynamic and longrope: the context length the model was pre-trained at.
    original_max_position: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions (GPT-OSS: not)
    attention_factor: float | None = None  # yarn, longrope: cos/sin scale; None = derived from factor
    # longrope: per-pair divisors of the frequencies, for contexts within the original and beyond it.
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    partial_rotary_factor: float = 1.0
    # GGUF's rope_freqs tensor: each pair's frequency is divided by its factor.
    freq_factors: tuple[float, ...] | None = None
    # Qwen-VL's multimodal rotary (M-RoPE): how many of each head's frequency pairs turn by a
    # token's frame, row and column position (in that order, or interleaved: Qwen3-VL).
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False


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


# Each rotary setting's range (low end excluded): real models keep far inside them
# (theta 1e4..1e8, factors 1..64).
_ROPE_RANGES = {"theta": 1e12, "factor": 1e6, "low_freq_factor": 1e6, "high_freq_factor": 1e6, "beta_fast": 1e6,
                "beta_slow": 1e6, "partial_rotary_factor": 1.0}


# config.json's activation names -> ours (the gated MLP's gate goes through it).
HIDDEN_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


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
    attention_bias: bool = False  # q/k/v projection biases (Qwen2, Llama's attention_bias)
    attention_out_bias: bool = False  # an o_proj bias (Llama's attention_bias)
    mlp_bias: bool = False  # gate/up/down biases (Llama's mlp_bias)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # the gate's activation: silu, or gelu_tanh (Gemma)
    norm_weight_offset: float = 0.0  # Gemma: RMSNorms scale by 1 + weight, in fp32
    sandwich_norms: bool = False  # Gemma 2/3: norms on the attention's and the MLP's outputs too
    embedding_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden); Granite's multiplier)
    residual_scale: float = 1.0  # each block's output times this before the residual add (Granite)
    logit_scale: float = 1.0  # logits times this (Granite: 1 / logits_scaling)
    attention_scale: float | None = None  # q.k times this; None: 1/sqrt(head_dim)
    attention_softcap: float = 0.0  # > 0: attention scores soft-capped (Gemma 2)
    final_softcap: float = 0.0  # > 0: logits soft-capped (Gemma 2)
    clip_qkv: float | None = None  # q, k and v clamped to +-this after their projection (OLMoE's option)
    attention_sinks: bool = False  # a learned logit per head joins each softmax (GPT-OSS)
    local_rope: RopeSpec | None = None  # the sliding layers' own rotary settings (Gemma 3)
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
    expert_bias: bool = False  # the router and every expert projection have biases (GPT-OSS)
    # GPT-OSS's experts: (alpha, limit) of gate * sigmoid(alpha * gate) * (up + 1), gate
    # clamped above at limit and up to +-limit; None: SwiGLU.
    clamped_swiglu: tuple[float, float] | None = None
    # An embedding model: how its last hidden states pool into one vector ("mean", "cls"
    # or "last" token); None: a generative model.
    pooling: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def query_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    def window_of(self, layer: int) -> int | None:
        """The sliding window layer ``layer`` attends within, or None for full attention
        (also where the window is as long as the context, as Phi-3.5's 262,144 over
        131,072 is: it limits nothing)."""
        if self.sliding_window is None or self.sliding_window >= self.max_position_embeddings:
            return None
        return None if layer in self.full_attention_layers else self.sliding_window

    def is_local_layer(self, layer: int) -> bool:
        """A sliding-window layer by its kind, whether or not its window limits anything:
        Gemma 3 gives these layers their own rotary base (``local_rope``) either way."""
        return self.sliding_window is not None and layer not in self.full_attention_layers

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
        for name in ("embedding_scale", "residual_scale", "logit_scale", "attention_scale", "attention_softcap",
                     "final_softcap", "clip_qkv"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and 0 <= value < 1e6):
                return f"{names.get(name, name)} {value} is not a finite number in 0..1e6"
        if (problem := self._float_problem(names)) is not None:
            return problem
        for name, ids in (("bos_token_id", [] if self.bos_token_id is None else [self.bos_token_id]),
                          ("eos_token_id", self.eos_token_ids)):
            wrong = [i for i in ids if type(i) is not int or not 0 <= i < self.vocab_size]
            if wrong:
                return f"{names.get(name, name)} {wrong[0]!r} is not a token id (0..{self.vocab_size - 1:,})"
        if self.hidden_act not in HIDDEN_ACTIVATIONS.values():
            return f"activation {self.hidden_act!r} is not supported ({', '.join(HIDDEN_ACTIVATIONS)})"
        for rope in (self.rope, self.local_rope):
            if rope is not None and rope.kind == "longrope":
                pairs = int(self.head_dim * rope.partial_rotary_factor) // 2
                if not len(rope.short_factor or ()) == len(rope.long_factor or ()) == pairs:
                    return f"longrope needs {pairs} short and long factors (one per rotated pair)"
        if self.num_heads % self.num_kv_heads:
            return f"{said('num_heads')} is not a multiple of {said('num_kv_heads')}"
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            return f"{said('num_experts_per_tok')} of {said('num_experts')} is not a valid routing"
        if self.clamped_swiglu is not None and not all(math.isfinite(v) and 0 < v < 1e6 for v in self.clamped_swiglu):
            return f"swiglu alpha and limit {self.clamped_swiglu} must be finite and positive"
        if self.num_experts and self.moe_intermediate_size <= 0:
            return f"{said('moe_intermediate_size')}: the experts' width must be positive"
        return None

    def _float_problem(self, names: Mapping[str, str]) -> str | None:
        """The first of the declared real numbers that is not finite and inside a range every
        real model keeps far within (NaN, negative or zero ones load, then write empty or
        garbage text)."""
        checks: list[tuple[str, object, float, float]] = [("rms_norm_eps", self.rms_norm_eps, 0.0, 1.0)]
        for label, rope in (("rope", self.rope), ("local_rope", self.local_rope)):
            if rope is None:
                continue
            checks += [(f"{label}.{name}", getattr(rope, name), 0.0, high) for name, high in _ROPE_RANGES.items()]
            if rope.attention_factor is not None:
                checks.append((f"{label}.attention_factor", rope.attention_factor, 0.0, 1e6))
            for name in ("short_factor", "long_factor", "freq_factors"):
                checks += [(f"{label}.{name}", value, 0.0, 1e6) for value in getattr(rope, name) or ()]
        for name, value, low, high in checks:
            if not (type(value) in (int, float) and math.isfinite(value) and low < value <= high):  # type: ignore[arg-type]
                return f"{names.get(name, name)} {value!r} is not a finite number in ({low:g}, {high:g}]"
        return None

    def qk_norm_size(self, projection_width: int) -> int:
        """The q (or k) norm's weight size for a projection this wide: a head's width, or
        the whole projection's where the norm spans all heads (OLMoE); 0 without q/k norms."""
        if not self.qk_norm:
            return 0
        return projection_width if ARCHITECTURES[self.architecture].qk_norm_whole else self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    def parameter_counts(self) -> ParameterCounts:
        """Parameters in all and those one token runs through (every expert counts in
        the total; only the ``num_experts_per_tok`` it is routed to in the active)."""
        hidden, heads, kv_heads, head_dim = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        q, kv = heads * head_dim, kv_heads * head_dim
        attention = hidden * (q + 2 * kv) + q * hidden + (q + 2 * kv if self.attention_bias else 0)
        attention += (self.qk_norm_size(q) + self.qk_norm_size(kv)) + (hidden if self.attention_out_bias else 0)
        attention += heads if self.attention_sinks else 0
        norms = (4 if self.sandwich_norms else 2) * hidden
        mlp = 3 * hidden * self.intermediate_size + (2 * self.intermediate_size + hidden if self.mlp_bias else 0)
        total = active = self.vocab_size * hidden * (1 if self.tie_word_embeddings else 2) + hidden
        for layer in range(self.num_layers):
            total += attention + norms
            active += attention + norms
            if not self.is_moe_layer(layer):
                total += mlp
                active += mlp
                continue
            expert = 3 * hidden * self.moe_intermediate_size
            expert += 2 * self.moe_intermediate_size + hidden if self.expert_bias else 0
            always = self.num_experts * (hidden + (1 if self.expert_bias else 0))  # the router
            if self.shared_expert_intermediate_size:
                always += 3 * hidden * self.shared_expert_intermediate_size + hidden  # and its gate
            total += always + self.num_experts * expert
            active += always + self.num_experts_per_tok * expert
        return ParameterCounts(total, active)


@dataclass(slots=True, frozen=True)
class ParameterCounts:
    total: int
    active: int  # per token
