"""config.json files shaped as the Hub publishes them for the architectures beyond Llama
(their documented values; the tensors are never needed): the spec read from each counts
the parameters transformers' own model has when built from the same file (on the meta
device, nothing allocated), and ``show`` states the sliding window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from localserve.facts.checkpoint import _windows
from localserve.formats.hf import spec_from_config

GEMMA_2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "bos_token_id": 2, "eos_token_id": [1, 107],
    "cache_implementation": "hybrid", "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "intermediate_size": 9216,
    "max_position_embeddings": 8192, "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "sliding_window": 4096, "torch_dtype": "float32", "vocab_size": 256000,
}
GEMMA_3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
    "attn_logit_softcapping": None, "final_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106],
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
    "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "vocab_size": 262144,
}
PHI_3_5_MINI = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu", "hidden_size": 3072,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-05,
    "rope_scaling": {"type": "longrope", "long_factor": [1.0 + i for i in range(48)],
                     "short_factor": [1.0 + i / 48 for i in range(48)]},
    "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": False, "vocab_size": 32064,
    "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000,
}
GRANITE_3_1_2B = {
    "architectures": ["GraniteForCausalLM"], "model_type": "granite", "attention_bias": False,
    "attention_multiplier": 0.015625, "embedding_multiplier": 12.0, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 8192, "logits_scaling": 8.0, "max_position_embeddings": 131072, "mlp_bias": False,
    "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8, "residual_multiplier": 0.22,
    "rms_norm_eps": 1e-05, "rope_theta": 5000000.0, "tie_word_embeddings": True, "vocab_size": 49155,
}
OLMOE_1B_7B = {
    "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "attention_bias": False, "clip_qkv": None,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 1024, "max_position_embeddings": 4096,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
    "num_hidden_layers": 16, "num_key_value_heads": 16, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "vocab_size": 50304, "bos_token_id": None, "eos_token_id": 50279,
    "pad_token_id": 1,
}
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                      "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "vocab_size": 201088,
}

CASES = {
    "gemma-2-2b": (GEMMA_2_2B, "; a sliding window of 4,096 on 13 of 26 layers"),
    "gemma-3-1b": (GEMMA_3_1B, "; a sliding window of 512 on 22 of 26 layers"),
    # Its window is longer than its context: it limits nothing, and is not one.
    "phi-3.5-mini": (PHI_3_5_MINI, ""),
    "granite-3.1-2b": (GRANITE_3_1_2B, ""),
    "olmoe-1b-7b": (OLMOE_1B_7B, ""),
    "gpt-oss-20b": (GPT_OSS_20B, "; a sliding window of 128 on 12 of 24 layers"),
}


@pytest.mark.parametrize("name", CASES)
def test_parameter_counts_and_windows_of_real_configs(tmp_path: Path, name: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config, windows = CASES[name]
    spec = spec_from_config(json.loads(json.dumps(config)))
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    assert spec.parameter_counts().total == reference.num_parameters()
    assert _windows(spec) == windows


def test_gemma_and_granite_read_as_their_references_compute() -> None:
    """The settings that are not sizes: Gemma's scales and caps, Gemma 3's two rotary
    bases, Granite's multipliers, Phi-3.5's longrope, GPT-OSS's rope and experts."""
    gemma2 = spec_from_config(dict(GEMMA_2_2B))
    assert (gemma2.attention_softcap, gemma2.final_softcap, gemma2.query_scale) == (50.0, 30.0, 256**-0.5)
    assert gemma2.embedding_scale == 2304**0.5 and gemma2.norm_weight_offset == 1.0 and gemma2.hidden_act == "gelu_tanh"
    assert gemma2.full_attention_layers == tuple(range(1, 26, 2))
    gemma3 = spec_from_config(dict(GEMMA_3_1B))
    assert gemma3.rope.theta == 1e6 and gemma3.local_rope is not None and gemma3.local_rope.theta == 1e4
    assert gemma3.full_attention_layers == (5, 11, 17, 23) and gemma3.qk_norm
    granite = spec_from_config(dict(GRANITE_3_1_2B))
    assert (granite.embedding_scale, granite.residual_scale, granite.attention_scale, granite.logit_scale) == (
        12.0, 0.22, 0.015625, 1 / 8)
    phi = spec_from_config(dict(PHI_3_5_MINI))
    assert phi.rope.kind == "longrope" and phi.rope.original_max_position == 4096 and phi.rope.factor == 32.0
    assert phi.window_of(0) is None
    oss = spec_from_config(json.loads(json.dumps(GPT_OSS_20B)))
    assert (oss.rope.kind, oss.rope.factor, oss.rope.original_max_position, oss.rope.truncate) == ("yarn", 32.0, 4096,
                                                                                                  False)
    assert oss.clamped_swiglu == (1.702, 7.0) and oss.attention_sinks and oss.expert_bias and oss.norm_topk_prob
    assert oss.full_attention_layers == tuple(range(1, 24, 2)) and oss.attention_bias and oss.attention_out_bias


# Gemma 3 4B as released: an image-text model whose text_config states only what differs
# from Gemma3TextConfig's defaults (heads, vocabulary, rotary bases, query scale omitted).
GEMMA_3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02,
    "mm_tokens_per_image": 256, "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}


def test_gemma_3_4b_text_model_counts_as_transformers_builds_it(tmp_path: Path) -> None:
    """The released config's text model: as many parameters as transformers' language
    model built from the same file, its windows and rotary settings as transformers reads
    them (the vision tower is not served)."""
    from transformers import AutoConfig, Gemma3ForConditionalGeneration

    from localserve.formats.multimodal import text_config

    spec = spec_from_config(text_config(json.loads(json.dumps(GEMMA_3_4B_IT))))
    (tmp_path / "config.json").write_text(json.dumps(GEMMA_3_4B_IT))
    config = AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        reference = Gemma3ForConditionalGeneration(config)
    assert spec.parameter_counts().total == reference.model.language_model.num_parameters()
    assert _windows(spec) == "; a sliding window of 1,024 on 29 of 34 layers"
    text = config.text_config
    assert spec.full_attention_layers == tuple(i for i, kind in enumerate(text.layer_types) if kind == "full_attention")
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (8, 4, 256, 262_208)
    assert (spec.rope.kind, spec.rope.factor, spec.rope.theta) == ("linear", 8.0, 1e6)
    assert spec.local_rope is not None and spec.local_rope.theta == 1e4 and spec.eos_token_ids == [1, 106]
