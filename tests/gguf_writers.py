"""Tiny GGUF files (llama, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite, Gemma, Phi-3) written with gguf-py, and the independent
reference: an HF fp32 model carrying gguf-py's own dequantization of every tensor."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from localserve.registry.builtin import DEMO

from .conftest import DATA, reinitialise

STORIES_GGUF = DATA / "models" / "stories260K.gguf"
# The vocabulary every tiny file carries: stories260K's, read from the demo model the package
# ships (the same 512 pieces, scores and types as tests/data's copy), so no test that writes a
# GGUF file needs anything beside the repository.
VOCAB_GGUF = DEMO.path
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    # Phi-3's fused projections: gate and up stay stacked in ffn_up.
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
}


MOE_TO_GGUF = {
    "gate": "ffn_gate_inp", "shared_expert.gate_proj": "ffn_gate_shexp", "shared_expert.up_proj": "ffn_up_shexp",
    "shared_expert.down_proj": "ffn_down_shexp", "shared_expert_gate": "ffn_gate_inp_shexp",
}
# Gemma's norms, as llama.cpp's converter names them.
GEMMA_NORMS_TO_GGUF = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                       "post_feedforward_layernorm": "post_ffw_norm"}
# transformers model_type -> GGUF architecture
GGUF_ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
                      "olmoe": "olmoe", "gpt_oss": "gpt-oss",
                      "granite": "granite", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}
# The converter permutes Q/K rows for these (its Llama model and subclasses).
PERMUTED_QK = {"llama", "granite"}
# GPT-OSS's pre-MLP norm and router, as the converter names them.
GPT_OSS_TO_GGUF = {"post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp"}
GEMMA = {"gemma2", "gemma3"}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<module...>.weight
    layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    if arch in GEMMA and module in GEMMA_NORMS_TO_GGUF:
        return f"blk.{layer}.{GEMMA_NORMS_TO_GGUF[module]}.{kind}"
    if arch == "gpt-oss" and module in GPT_OSS_TO_GGUF:
        return f"blk.{layer}.{GPT_OSS_TO_GGUF[module]}.{kind}"
    if arch == "gpt-oss" and module == "self_attn" and kind == "sinks":
        return f"blk.{layer}.attn_sinks.weight"
    if module.startswith("mlp.") and module.removeprefix("mlp.") in MOE_TO_GGUF:
        return f"blk.{layer}.{MOE_TO_GGUF[module.removeprefix('mlp.')]}.{kind}"
    return f"blk.{layer}.{LAYER_TO_GGUF[module]}.{kind}"


def expert_tensor(hf_name: str, projection: str) -> str:
    return f"blk.{hf_name.split('.')[2]}.ffn_{projection}_exps.weight"


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """The model's tensors under GGUF names, as llama.cpp's converter lays them out:
    Q/K rows permuted for arch llama, each layer's experts stacked per projection
    (``ffn_gate_exps [E, I, H]`` ...), the shared expert's gate a vector."""
    config = model.config
    arch = GGUF_ARCHITECTURES[config.model_type]
    llama = arch in PERMUTED_QK
    tensors = {}
    for name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if arch in GEMMA and name.endswith("norm.weight"):
            array = array + 1  # the converter stores Gemma's norms as 1 + w
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if arch == "gpt-oss" and ".mlp.experts." in name:  # [E, in, out], gate and up interleaved
            tensors.update(gpt_oss_experts(name, array))
            continue
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers 5 keeps experts stacked, gate and up fused
            gate, up = np.split(array, 2, axis=1)
            tensors[expert_tensor(name, "gate")] = np.ascontiguousarray(gate)
            tensors[expert_tensor(name, "up")] = np.ascontiguousarray(up)
            continue
        if name.endswith("mlp.experts.down_proj"):
            tensors[expert_tensor(name, "down")] = array
            continue
        if name.endswith("shared_expert_gate.weight"):
            array = array.reshape(-1)
        elif llama and name.endswith("q_proj.weight"):
            array = permute_rows(array, config.num_attention_heads)
        elif llama and name.endswith("k_proj.weight"):
            array = permute_rows(array, config.num_key_value_heads)
        tensors[gguf_name(name, arch)] = np.ascontiguousarray(array)
    return tensors


def gpt_oss_experts(name: str, array: np.ndarray) -> dict[str, np.ndarray]:
    """A GPT-OSS expert tensor as the converter writes it: weights transposed to
    ``[E, out, in]``, gate and up (even and odd outputs) apart, biases ``[E, out]``."""
    layer, part = name.split(".")[2], name.rsplit(".", 1)[-1]
    if part.endswith("_bias"):
        pieces = {"down": array} if part.startswith("down") else {"gate": array[:, 0::2], "up": array[:, 1::2]}
        return {f"blk.{layer}.ffn_{p}_exps.bias": np.ascontiguousarray(a) for p, a in pieces.items()}
    rows = array.transpose(0, 2, 1)
    pieces = {"down": rows} if part.startswith("down") else {"gate": rows[:, 0::2], "up": rows[:, 1::2]}
    return {f"blk.{layer}.ffn_{p}_exps.weight": np.ascontiguousarray(a) for p, a in pieces.items()}


def gpt_oss_packed(name: str, values: dict[str, np.ndarray]) -> np.ndarray:
    """The inverse of ``gpt_oss_experts``: HF's ``[E, in, out]`` (or ``[E, out]`` bias),
    gate and up interleaved, from the file's tensors."""
    layer, part = name.split(".")[2], name.rsplit(".", 1)[-1]
    kind = "bias" if part.endswith("_bias") else "weight"
    if part.startswith("down"):
        rows = values[f"blk.{layer}.ffn_down_exps.{kind}"]
    else:
        gate, up = values[f"blk.{layer}.ffn_gate_exps.{kind}"], values[f"blk.{layer}.ffn_up_exps.{kind}"]
        rows = np.stack([gate, up], axis=2).reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])
    return rows if kind == "bias" else rows.transpose(0, 2, 1)


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: half-split rotary rows -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stories_vocab() -> dict:
    """The real 512-token SentencePiece vocabulary (llama.cpp needs a vocab to load a file)."""
    import gguf

    reader = gguf.GGUFReader(VOCAB_GGUF)
    field = reader.fields
    tokens = [bytes(field["tokenizer.ggml.tokens"].parts[i]).decode() for i in field["tokenizer.ggml.tokens"].data]
    scores = [float(field["tokenizer.ggml.scores"].parts[i][0]) for i in field["tokenizer.ggml.scores"].data]
    types = [int(field["tokenizer.ggml.token_type"].parts[i][0]) for i in field["tokenizer.ggml.token_type"].data]
    return {"tokens": tokens, "scores": scores, "types": types}


def tiny_llama(hidden: int = 256, ffn: int = 512, layers: int = 2, seed: int = 3):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    reinitialise(model, seed=seed)
    # The residual stream starts at unit scale, as in trained models, rather than at the
    # 1/sqrt(hidden) of the other matrices. Otherwise every layer's output dwarfs it and
    # llama.cpp's 8-bit rounding of activations (inside its quantized dot products, so
    # unavoidable in the oracle) alone moves the logits by 3-4e-2; at unit scale, ~2e-2.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(hidden**0.5)
    return model.eval()


def write_gguf(path: Path, model, qtype, exclude: tuple[str, ...] = (), expert_qtype=None, pooling=None,
               add_eos: bool = False) -> None:
    """Every matrix (and stacked experts) in ``qtype`` (gguf-py quantizes it), vectors
    in F32; the stacked experts in ``expert_qtype`` when given; tensors named in
    ``exclude`` (GGUF names) are left out. ``pooling`` (a gguf.PoolingType) makes it an
    embedding model; ``add_eos``: the tokenizer appends EOS (as Qwen3-Embedding's does)."""
    import gguf

    config = model.config
    arch = GGUF_ARCHITECTURES[config.model_type]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    vocab = stories_vocab()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.rope_parameters or {}
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(rope.get("full_attention", rope).get("rope_theta", 10000.0)))
    if arch == "granite":
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if arch in GEMMA:
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "phi3":  # the converter writes 0 for none; llama.cpp ignores Phi's window either way
        writer.add_sliding_window(config.sliding_window or 0)
    if rope.get("rope_type") == "longrope":  # as the Phi-3 converter writes it: no scaling type
        original = config.original_max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for which in ("long", "short"):
            writer.add_tensor(f"rope_factors_{which}.weight", np.array(rope[f"{which}_factor"], dtype=np.float32))
    if arch == "gpt-oss":
        writer.add_sliding_window(config.sliding_window)
        writer.add_expert_feed_forward_length(config.intermediate_size)
        rope_parameters = config.rope_parameters
        if rope_parameters.get("rope_type") == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope_parameters["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope_parameters["original_max_position_embeddings"])
    if config.model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"):
        writer.add_expert_count(getattr(config, "num_local_experts", None) or config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if config.model_type not in ("mixtral", "olmoe", "gpt_oss"):  # their experts are feed_forward_length wide
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if config.model_type == "qwen2_moe":
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_scores(vocab["scores"])
    writer.add_token_types(vocab["types"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if add_eos:
        writer.add_add_eos_token(True)
    if pooling is not None:
        writer.add_pooling_type(pooling)
    for name, array in gguf_tensors(model).items():
        if name in exclude:
            continue
        # Routers stay F32, as llama.cpp's quantizer leaves them.
        if expert_qtype is not None and name.endswith("_exps.weight"):
            writer.add_tensor(name, gguf.quants.quantize(array, expert_qtype), raw_dtype=expert_qtype)
        elif (array.ndim == 1 or name.endswith(".bias") or qtype == gguf.GGMLQuantizationType.F32
              or name.endswith("ffn_gate_inp.weight")):
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def dequantized_reference(path: Path, model):
    """The HF model with every weight replaced by gguf-py's dequantization of the file."""
    import gguf

    values = {}
    for tensor in gguf.GGUFReader(path).tensors:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values[tensor.name] = np.array(array.reshape([int(d) for d in reversed(tensor.shape)]), dtype=np.float32)
    # Undo gguf_tensors: each model tensor from the file's tensors that made it.
    config = model.config
    arch = GGUF_ARCHITECTURES[config.model_type]
    llama = arch in PERMUTED_QK
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            array = values["token_embd.weight"]
        elif arch == "gpt-oss" and ".mlp.experts." in name:
            array = gpt_oss_packed(name, values)
        elif name.endswith("mlp.experts.gate_up_proj"):
            array = np.concatenate([values[expert_tensor(name, "gate")], values[expert_tensor(name, "up")]], axis=1)
        elif name.endswith("mlp.experts.down_proj"):
            array = values[expert_tensor(name, "down")]
        else:
            array = values[gguf_name(name, arch)]
            if arch in GEMMA and name.endswith("norm.weight"):
                array = array - 1
            if llama and name.endswith("q_proj.weight"):
                array = unpermute_rows(array, config.num_attention_heads)
            elif llama and name.endswith("k_proj.weight"):
                array = unpermute_rows(array, config.num_key_value_heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(array)).reshape(tensor.shape)
    reference = type(model)(config)
    reference.load_state_dict(state)
    return reference.eval()


def tiny_moe(kind: str, seed: int = 5):
    """A two-layer Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE at widths every GGUF type can
    hold (rows of 256), 4 experts, top-2; initialised as ``tiny_llama``, routers at 4x.
    OLMoE has as many K/V heads as query heads: llama.cpp sizes its k norm by the hidden
    width, as the real OLMoE (16 and 16 heads) has it."""
    from transformers import MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig
    from transformers import Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    hidden = 256
    base = dict(vocab_size=512, hidden_size=hidden, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2, num_experts_per_tok=2)
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**base, num_local_experts=4, sliding_window=None))
    elif kind == "olmoe":
        model = OlmoeForCausalLM(OlmoeConfig(**{**base, "num_key_value_heads": 4}, num_experts=4))
    elif kind == "qwen2_moe":
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**base, num_experts=4, moe_intermediate_size=256,
                                                   shared_expert_intermediate_size=256, norm_topk_prob=False))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**base, num_experts=4, moe_intermediate_size=256, head_dim=32,
                                                   norm_topk_prob=True))
    reinitialise(model, seed=seed)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(hidden**0.5)
    return model.eval()


def tiny_variant(kind: str, seed: int = 7):
    """Granite, Gemma 2, Gemma 3 and Phi-3 at widths every GGUF type can hold (rows of
    256): the variants' settings as in tests/conftest.py's tiny configs, with a sliding
    window of 12 over 4 layers (Gemma 3: its 6th layer full); Phi-3 as Phi-4-mini (tied,
    longrope over a 64-token original context on 3/4 of each head); initialised as
    ``tiny_llama``."""
    from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GraniteConfig, Phi3Config)

    hidden = 256
    base = dict(vocab_size=512, hidden_size=hidden, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)
    if kind == "granite":
        config = GraniteConfig(**base, tie_word_embeddings=False, embedding_multiplier=12.0,
                               residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0)
    elif kind == "gemma2":
        config = Gemma2Config(**base, head_dim=64, query_pre_attn_scalar=64, sliding_window=12,
                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    elif kind == "phi3":
        config = Phi3Config(**base, tie_word_embeddings=True, original_max_position_embeddings=64,
                            sliding_window=None, partial_rotary_factor=0.75,
                            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                             "partial_rotary_factor": 0.75,
                                             "short_factor": [1.0 + i / 20 for i in range(24)],
                                             "long_factor": [1.0 + i / 2 for i in range(24)]})
    else:
        config = Gemma3TextConfig(**{**base, "num_hidden_layers": 6}, head_dim=64, query_pre_attn_scalar=64,
                                  sliding_window=12,
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                   "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config)
    reinitialise(model, seed=seed)
    # Unit-scale residual stream, as tiny_llama's (Gemma scales its own).
    if kind in ("granite", "phi3"):
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(hidden**0.5 / getattr(config, "embedding_multiplier", 1.0))
    return model.eval()


def tiny_gpt_oss(seed: int = 9):
    """A four-layer GPT-OSS at widths MXFP4 and every GGUF type can hold (rows of 256):
    4 experts, top-2, window 12 on every other layer, yarn rope truncated as llama.cpp
    computes it, and the real swiglu limit (7: llama.cpp fixes it in code; the HF tests
    use one that clamps more); initialised as ``tiny_llama``."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    hidden = 256
    config = GptOssConfig(vocab_size=512, hidden_size=hidden, intermediate_size=256, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                          rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=12, swiglu_limit=7.0, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                           "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "truncate": True})
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config)
    reinitialise(model, seed=seed)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(hidden**0.5)
    return model.eval()


def split_gguf(source: Path, target: Path, parts: int) -> list[Path]:
    """``source`` re-written as ``parts`` shards the way llama.cpp's gguf-split lays them
    out, by gguf-py's own splitting writer: ``<target stem>-0000i-of-0000N.gguf``, every
    metadata entry in the first shard, ``split.no`` / ``split.count`` /
    ``split.tensors.count`` in each, the tensors in order, about evenly over the shards."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    per_shard = -(-len(reader.tensors) // parts)
    writer = gguf.GGUFWriter(str(target), arch, split_max_tensors=per_shard)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the header's counts, and the key the writer adds itself
        main_type = field.types[0]
        sub_type = field.types[-1] if main_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), main_type, sub_type=sub_type)
    for tensor in reader.tensors:
        # The reader's arrays are shaped like the writer wants them: bytes per row for block types.
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    paths = [target.with_name(f"{target.stem}-{i:05d}-of-{parts:05d}.gguf") for i in range(1, parts + 1)]
    assert all(path.is_file() for path in paths), "gguf-py split into a different number of files"
    return paths
