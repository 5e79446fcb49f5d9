"""The architectures localserve runs, one entry each: how the HF and GGUF readers
recognise one and what differs between them. Every Llama-like model (Gemma, Phi-3 and
Granite included) is the same decoder (models/llama.py); adding one is an entry here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str  # ModelSpec.architecture
    hf_model_types: tuple[str, ...]  # config.json's model_type values that are this
    gguf_name: str | None  # GGUF general.architecture (None: found another way, see by_gguf)
    attention_bias: bool = False  # q/k/v projections with biases (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head's q and k (Qwen3)
    qk_norm_whole: bool = False  # the q/k RMSNorm spans all heads' q (and k) at once (OLMoE)
    moe: str | None = None  # the MoE config family: "mixtral", "qwen", "olmoe" or "gpt_oss"; None: dense
    moe_block: str = "mlp"  # the HF module holding a layer's router and experts
    # Each expert's projections in HF checkpoints: gate, up, down (default: gate_proj, ...).
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    renormalize_gates: bool = True  # GGUF: llama.cpp renormalises the chosen experts' gates
    sliding_window_needs_flag: bool = False  # config.json's sliding_window holds only with use_sliding_window
    gguf_permuted_qk: bool = False  # GGUF: the converter permuted the Q/K rows (arch llama)
    # Gemma: RMSNorms scale by (1 + weight), norms after attention and after the MLP as well
    # as before, embeddings times sqrt(hidden).
    gemma: bool = False
    tied_embeddings: bool = False  # config.json's tie_word_embeddings when it does not say (Gemma: tied)
    # Sliding and full layers alternate: every n-th layer is full (when config.json lists no
    # layer_types and states no sliding_window_pattern of its own).
    sliding_window_pattern: int | None = None
    fused_projections: bool = False  # HF checkpoints hold qkv_proj and gate_up_proj whole (Phi-3)
    # HF checkpoints hold each layer's experts as 3-D tensors, MXFP4 or dense, renamed by
    # formats/gpt_oss.py (GPT-OSS).
    packed_experts: bool = False
    attention_sinks: bool = False  # a learned logit per head joins each softmax (GPT-OSS)
    expert_bias: bool = False  # the router and every expert projection have biases (GPT-OSS)
    # The experts' clamped SwiGLU (alpha, limit) (GPT-OSS; config.json may restate them,
    # llama.cpp fixes them in code).
    clamped_swiglu: tuple[float, float] | None = None


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", ("llama", "mistral"), "llama", gguf_permuted_qk=True),
    Architecture("qwen2", ("qwen2",), "qwen2", attention_bias=True, sliding_window_needs_flag=True),
    Architecture("qwen3", ("qwen3",), "qwen3", qk_norm=True, sliding_window_needs_flag=True),
    # In GGUF, Mixtral is arch llama with experts.
    Architecture("mixtral", ("mixtral",), None, moe="mixtral", moe_block="block_sparse_moe",
                 expert_names=("w1", "w3", "w2"), gguf_permuted_qk=True),
    Architecture("qwen2_moe", ("qwen2_moe",), "qwen2moe", attention_bias=True, moe="qwen", renormalize_gates=False,
                 sliding_window_needs_flag=True),
    Architecture("qwen3_moe", ("qwen3_moe",), "qwen3moe", qk_norm=True, moe="qwen", sliding_window_needs_flag=True),
    # OLMoE: Qwen-like experts (no shared one), q/k norms over the whole projection, gates
    # not renormalised (llama.cpp: never; transformers: norm_topk_prob, false in every release).
    Architecture("olmoe", ("olmoe",), "olmoe", qk_norm=True, qk_norm_whole=True, moe="olmoe",
                 renormalize_gates=False),
    # GPT-OSS: biases everywhere, attention sinks, sliding and full layers alternating, a
    # clamped SwiGLU in its experts, gates a softmax over the chosen experts' logits.
    Architecture("gpt_oss", ("gpt_oss",), "gpt-oss", moe="gpt_oss", sliding_window_pattern=2, packed_experts=True,
                 attention_sinks=True, expert_bias=True, clamped_swiglu=(1.702, 7.0)),
    Architecture("granite", ("granite",), "granite", gguf_permuted_qk=True),
    Architecture("gemma2", ("gemma2",), "gemma2", gemma=True, tied_embeddings=True, sliding_window_pattern=2),
    Architecture("gemma3", ("gemma3_text",), "gemma3", gemma=True, tied_embeddings=True, qk_norm=True,
                 sliding_window_pattern=6),
    Architecture("phi3", ("phi3",), "phi3", fused_projections=True),
)}

HF_MODEL_TYPES = {t: a for a in ARCHITECTURES.values() for t in a.hf_model_types}
GGUF_NAMES = {a.gguf_name: a for a in ARCHITECTURES.values() if a.gguf_name is not None}
# llama.cpp's image-text models' text models: Qwen2's (Qwen2-VL, Qwen2.5-VL), Qwen3's and
# Qwen3-MoE's (Qwen3-VL), their rotary in M-RoPE sections (rope.dimension_sections); the
# image tower's deepstack features (qwen3vl.n_deepstack_layers) come from the projector.
GGUF_NAMES["qwen2vl"] = ARCHITECTURES["qwen2"]
GGUF_NAMES["qwen3vl"] = ARCHITECTURES["qwen3"]
GGUF_NAMES["qwen3vlmoe"] = ARCHITECTURES["qwen3_moe"]
# Those GGUF names -> whether llama.cpp interleaves their M-RoPE sections (its IMROPE, fixed
# in code for Qwen3-VL as config.json's mrope_interleaved says) rather than running them in turn.
GGUF_MROPE = {"qwen2vl": False, "qwen3vl": True, "qwen3vlmoe": True}


def by_gguf(gguf_name: str, has_experts: bool) -> Architecture | None:
    """The architecture of a GGUF file's ``general.architecture``; arch llama with
    experts is Mixtral."""
    if gguf_name == "llama" and has_experts:
        return ARCHITECTURES["mixtral"]
    return GGUF_NAMES.get(gguf_name)
