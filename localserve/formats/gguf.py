"""GGUF files' metadata (llama, qwen2, qwen3, granite, gemma2, gemma3, phi3 architectures; Mixtral
as llama with experts, qwen2moe, qwen3moe, olmoe, gpt-oss; qwen2vl, qwen3vl and qwen3vlmoe as
their text models) -> ModelSpec and chat template, and the map from GGUF tensor names to HF's
(the experts' stacked ``*_exps`` tensors to ``<moe block>.experts.<gate|up|down>_proj.weight``,
one row block per expert). Needs no torch: formats/weights.py turns the tensors into weights.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ..errors import LocalserveError
from ..text.chat_template import ChatTemplate, NoChatTemplateError
from .architectures import ARCHITECTURES, GGUF_MROPE, GGUF_NAMES, Architecture, by_gguf
from .gguf_file import GGUFFile
from .spec import ModelSpec, RopeSpec

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q, k and v in one tensor
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # GPT-OSS's pre-MLP norm
}
# Tensors whose HF name has no .weight suffix (llama.cpp's converter adds one).
_BARE_NAMES = {"attn_sinks": "self_attn.sinks"}
# MoE tensors, under the layer's MoE block (``mlp`` or Mixtral's ``block_sparse_moe``).
MOE_NAMES = {
    "ffn_gate_inp": "gate",
    "ffn_gate_exps": "experts.gate_proj",
    "ffn_up_exps": "experts.up_proj",
    "ffn_down_exps": "experts.down_proj",
    "ffn_gate_inp_shexp": "shared_expert_gate",
    "ffn_gate_shexp": "shared_expert.gate_proj",
    "ffn_up_shexp": "shared_expert.up_proj",
    "ffn_down_shexp": "shared_expert.down_proj",
}
# Gemma's four norms: llama.cpp calls the pre-MLP norm ffn_norm, as for Llama, and adds the
# attention's and the MLP's output norms.
_GEMMA_NORMS = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3's ffn_up holds gate and up stacked, as HF's gate_up_proj (there is no ffn_gate).
_FUSED_NAMES = {"ffn_up": "mlp.gate_up_proj"}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Per-pair rotary frequency divisors: llama.cpp's form of llama3 rope scaling, and
# longrope's two sets (Phi-3.5/4), chosen by the served context as llama.cpp does.
ROPE_FREQS = "rope_freqs.weight"
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
ROPE_FACTORS_LONG = "rope_factors_long.weight"
# Tensors read with the metadata, into the spec, rather than loaded as weights.
ROPE_TENSORS = (ROPE_FREQS, ROPE_FACTORS_SHORT, ROPE_FACTORS_LONG)


def hf_name(name: str, architecture: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = LAYER_TENSOR.fullmatch(name)
    if match and match[2] in _BARE_NAMES and match[3] == "weight":
        return f"model.layers.{match[1]}.{_BARE_NAMES[match[2]]}"
    if match and ARCHITECTURES[architecture].fused_projections and match[2] in _FUSED_NAMES:
        return f"model.layers.{match[1]}.{_FUSED_NAMES[match[2]]}.{match[3]}"
    if match and ARCHITECTURES[architecture].gemma and match[2] in _GEMMA_NORMS:
        return f"model.layers.{match[1]}.{_GEMMA_NORMS[match[2]]}.{match[3]}"
    if match and match[2] in _LAYER_NAMES:
        return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"
    if match and match[2] in MOE_NAMES:
        return f"model.layers.{match[1]}.{ARCHITECTURES[architecture].moe_block}.{MOE_NAMES[match[2]]}.{match[3]}"
    return None


class _Metadata:
    """Typed access to ``<arch>.*`` keys, with errors that name the file and key."""

    def __init__(self, gguf: GGUFFile, arch: str) -> None:
        self.gguf, self.arch = gguf, arch

    def get(self, key: str, kind: type, default: Any = ...) -> Any:
        full = key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"
        value = self.gguf.metadata.get(full, default)
        if value is ...:
            raise LocalserveError(f"{self.gguf.path}: metadata {full} is missing")
        if value is None or value is default:
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
        if kind is list and isinstance(value, list):
            return value
        raise LocalserveError(f"{self.gguf.path}: metadata {full} has an unexpected value {value!r}")


def spec_from_gguf(gguf: GGUFFile) -> ModelSpec:
    arch = gguf.metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_NAMES:
        raise LocalserveError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_NAMES)})"
        )
    md = _Metadata(gguf, arch)
    num_experts = md.get("expert_count", int, 0)
    architecture = by_gguf(arch, bool(num_experts))
    assert architecture is not None
    # MoE files may omit the dense width; Mixtral's experts are feed_forward_length wide.
    intermediate = md.get("feed_forward_length", int, 0 if num_experts else ...)
    hidden = md.get("embedding_length", int)
    heads = md.get("attention.head_count", int)
    if not hidden or not heads:
        raise LocalserveError(f"{gguf.path}: embedding_length and head_count must be positive")
    kv_heads = md.get("attention.head_count_kv", int, heads) or heads
    head_dim = md.get("attention.key_length", int, hidden // heads)
    if not head_dim:
        raise LocalserveError(f"{gguf.path}: embedding_length {hidden:,} over head_count {heads:,} heads leaves "
                              "no head size")
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise LocalserveError(f"{gguf.path}: tensor token_embd.weight is missing")
    vocab = embed.shape[0]
    if isinstance(tokens, list) and len(tokens) > vocab:
        raise LocalserveError(f"{gguf.path}: {len(tokens)} tokens but {vocab} embedding rows")
    eos = [md.get(k, int, None) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    spec = ModelSpec(
        architecture=architecture.name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=md.get("block_count", int),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=md.get("attention.layer_norm_rms_epsilon", float, 1e-5),
        rope=_rope(gguf, md, head_dim),
        max_position_embeddings=md.get("context_length", int, 4096),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        attention_out_bias="blk.0.attn_output.bias" in gguf.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in gguf.tensors,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id", int, None),
        eos_token_ids=list(dict.fromkeys(e for e in eos if e is not None)),
        num_experts=num_experts,
        num_experts_per_tok=md.get("expert_used_count", int, 0),
        moe_intermediate_size=md.get("expert_feed_forward_length", int, intermediate if num_experts else 0),
        shared_expert_intermediate_size=_shared_expert_width(gguf),
        # llama.cpp renormalises the chosen gates for Mixtral and Qwen3-MoE, not Qwen2-MoE.
        norm_topk_prob=architecture.renormalize_gates,
        pooling=_pooling(gguf, md.get("pooling_type", int, 0)),
        **_variant_fields(md, architecture, hidden, heads, head_dim),
    )
    problem = spec.check({field: key if key.startswith("tokenizer.") else f"{arch}.{key}"
                          for field, key in _METADATA_KEYS.items()})
    if problem:
        raise LocalserveError(f"{gguf.path}: metadata {problem}")
    if gguf.metadata.get(f"{arch}.attention.causal", True) is not True:  # gte-Qwen2's embedding models
        raise LocalserveError(f"{gguf.path}: bidirectional attention ({arch}.attention.causal false) is not supported")
    layers = {int(match[1]) for name in gguf.tensors if (match := LAYER_TENSOR.fullmatch(name))}
    if layers != set(range(spec.num_layers)):
        numbered = f", numbered up to {max(layers):,}" if layers else ""
        raise LocalserveError(f"{gguf.path}: block_count is {spec.num_layers:,} but the file holds tensors of "
                              f"{len(layers):,} layers{numbered}")
    if embed.shape != (vocab, hidden):
        raise LocalserveError(f"{gguf.path}: token_embd.weight is {embed.shape}, not {vocab} x embedding_length "
                              f"{hidden:,}")
    return spec


# llama.cpp's pooling types (enum llama_pooling_type) that make a model an embedding model.
_POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}


def _pooling(gguf: GGUFFile, kind: int) -> str | None:
    if kind == 0:
        return None  # none: a generative model
    if kind == 4:
        raise LocalserveError(f"{gguf.path}: a reranker (pooling type rank) is not supported; "
                              "embedding models (mean, cls, last) and generative models are")
    if kind not in _POOLING_TYPES:
        raise LocalserveError(f"{gguf.path}: pooling_type {kind} is not one llama.cpp defines (0-4)")
    return _POOLING_TYPES[kind]


def _variant_fields(md: _Metadata, architecture: Architecture, hidden: int, heads: int,
                    head_dim: int) -> dict[str, Any]:
    """Granite's multipliers, Gemma's scales, soft caps and windows, GPT-OSS's sinks and
    experts, as llama.cpp reads them; what llama.cpp fixes in code rather than the file
    (the window patterns, Gemma 3's local rotary base, Gemma's attention scale, GPT-OSS's
    SwiGLU) is fixed here the same way."""
    fields: dict[str, Any] = dict(
        embedding_scale=md.get("embedding_scale", float, 1.0),
        residual_scale=md.get("residual_scale", float, 1.0),
        logit_scale=1.0 / (md.get("logit_scale", float, 1.0) or 1.0),
        attention_scale=md.get("attention.scale", float, None),
        attention_softcap=md.get("attn_logit_softcapping", float, 0.0),
        final_softcap=md.get("final_logit_softcapping", float, 0.0),
    )
    # What llama.cpp fixes in code for GPT-OSS: sinks, biased experts, their SwiGLU.
    fields |= dict(attention_sinks=architecture.attention_sinks, expert_bias=architecture.expert_bias,
                   clamped_swiglu=architecture.clamped_swiglu)
    layers = md.get("block_count", int)
    pattern = architecture.sliding_window_pattern
    if pattern:  # sliding and full layers alternating, every pattern-th layer full
        window = md.get("attention.sliding_window", int, _WINDOW_DEFAULTS.get(architecture.name))
        fields |= dict(sliding_window=window or None,
                       full_attention_layers=tuple(i for i in range(layers) if (i + 1) % pattern == 0) if window else ())
    if not architecture.gemma:
        return fields
    # The 27B models scale queries by hidden / heads, the others by the head size.
    large = (architecture.name, layers) in (("gemma2", 46), ("gemma3", 62))
    return fields | dict(
        # llama.cpp's converter stores Gemma's norm weights as 1 + w already.
        hidden_act="gelu_tanh", sandwich_norms=True, embedding_scale=hidden**0.5,
        attention_scale=(hidden // heads if large else head_dim) ** -0.5,
        local_rope=RopeSpec(theta=10000.0) if architecture.name == "gemma3" else None,
    )


# A window the file does not state: llama.cpp's default for Gemma 2; GPT-OSS must state
# it (``...``: required); Gemma 3 without one attends fully.
_WINDOW_DEFAULTS: dict[str, Any] = {"gemma2": 4096, "gpt_oss": ...}


# What GGUF metadata calls the spec's fields (under "<arch>.", but for the tokenizer's).
_METADATA_KEYS = {
    "num_layers": "block_count", "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
    "num_heads": "attention.head_count", "num_kv_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length", "max_position_embeddings": "context_length", "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count", "moe_intermediate_size": "expert_feed_forward_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope.theta": "rope.freq_base",
    "rope.factor": "rope.scaling.factor", "rope.attention_factor": "rope.scaling.attn_factor",
    "bos_token_id": "tokenizer.ggml.bos_token_id", "eos_token_id": "tokenizer.ggml.eos_token_id",
}


def _shared_expert_width(gguf: GGUFFile) -> int:
    # Read off the tensor: llama.cpp does too when expert_shared_feed_forward_length is absent.
    info = gguf.tensors.get("blk.0.ffn_up_shexp.weight")
    return info.shape[0] if info is not None and len(info.shape) == 2 else 0


def _rope(gguf: GGUFFile, md: _Metadata, head_dim: int) -> RopeSpec:
    rotary_dim = md.get("rope.dimension_count", int, head_dim)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise LocalserveError(f"{gguf.path}: rope.dimension_count {rotary_dim} does not fit head size {head_dim}")
    kind = md.get("rope.scaling.type", str, "none")
    rope = RopeSpec(theta=md.get("rope.freq_base", float, 10000.0), partial_rotary_factor=rotary_dim / head_dim)
    if kind in ("linear", "yarn"):
        rope.kind = kind
        rope.factor = md.get("rope.scaling.factor", float, 1.0)
        rope.original_max_position = md.get("rope.scaling.original_context_length", int, None)
        if kind == "yarn" and rope.original_max_position is None:
            raise LocalserveError(f"{gguf.path}: yarn rope scaling needs rope.scaling.original_context_length")
    elif kind != "none":
        raise LocalserveError(f"{gguf.path}: rope scaling type {kind!r} is not supported (linear, yarn)")
    pairs = rotary_dim // 2
    # M-RoPE (qwen2vl, qwen3vl): frame, row, column, (unused); llama.cpp requires the sections there.
    sections = md.get("rope.dimension_sections", list, ... if md.arch in GGUF_MROPE else None)
    if sections is not None:
        if len(sections) < 3 or any(type(s) is not int or s < 0 for s in sections) or sum(sections[:3]) != pairs:
            raise LocalserveError(f"{gguf.path}: rope.dimension_sections {sections!r} do not split the head's "
                                  f"{pairs} frequency pairs in three")
        rope.mrope_section = tuple(sections[:3])
        rope.mrope_interleaved = GGUF_MROPE.get(md.arch, False)
    rope.freq_factors = _float_vector(gguf, ROPE_FREQS, pairs)
    rope.short_factor = _float_vector(gguf, ROPE_FACTORS_SHORT, pairs)
    rope.long_factor = _float_vector(gguf, ROPE_FACTORS_LONG, pairs)
    if (rope.short_factor is None) != (rope.long_factor is None):
        raise LocalserveError(f"{gguf.path}: {ROPE_FACTORS_SHORT} and {ROPE_FACTORS_LONG} come together")
    if rope.long_factor is not None:
        # longrope as llama.cpp's converter writes it: no scaling type, the factor sets as
        # tensors, the growth as the two context lengths, the cos/sin scale stated.
        original = md.get("rope.scaling.original_context_length", int)
        if not original:
            raise LocalserveError(f"{gguf.path}: rope.scaling.original_context_length must be positive")
        rope.kind, rope.original_max_position = "longrope", original
        rope.factor = md.get("context_length", int, original) / original
        rope.attention_factor = md.get("rope.scaling.attn_factor", float, None)
    return rope


def _float_vector(gguf: GGUFFile, name: str, length: int) -> tuple[float, ...] | None:
    """A small F32/F16 tensor of ``length`` values read as metadata, or None if absent."""
    info = gguf.tensors.get(name)
    if info is None:
        return None
    stored = _PLAIN_FLOATS.get(info.ggml_type)
    if stored is None or info.shape != (length,):
        raise LocalserveError(f"{gguf.path}: {name} must be {length} plain floats (F32 or F16)")
    return tuple(float(f) for f in gguf.tensor_bytes(name).view(stored))


# GGML type id -> numpy dtype, for the small float vectors read with the metadata.
_PLAIN_FLOATS = {0: np.dtype("<f4"), 1: np.dtype("<f2")}


def chat_template_from_gguf(gguf: GGUFFile, source: str | None = None) -> ChatTemplate:
    """``tokenizer.chat_template`` (or ``source``, a Modelfile's TEMPLATE, in its place)
    with the BOS/EOS token texts from the vocabulary."""
    metadata = gguf.metadata
    template = metadata.get("tokenizer.chat_template") if source is None else source
    if not isinstance(template, str):
        raise NoChatTemplateError(
            f"{gguf.path}: this model has no chat template (no tokenizer.chat_template); "
            "send plain prompts instead of chat messages"
        )
    tokens = metadata.get("tokenizer.ggml.tokens") or []

    def token(key: str) -> str | None:
        index = metadata.get(key)
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    return ChatTemplate(
        template, bos_token=token("tokenizer.ggml.bos_token_id"), eos_token=token("tokenizer.ggml.eos_token_id")
    )
