"""Tiny llama-architecture GGUF files written with gguf-py, and the independent
reference: an HF fp32 model carrying gguf-py's own dequantization of every tensor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .conftest import SHARED, reinitialise

STORIES_GGUF = SHARED / "models" / "stories260K.gguf"
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<module...>.weight
    layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{layer}.{LAYER_TO_GGUF[module]}.{kind}"


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: half-split rotary rows -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stories_vocab() -> dict:
    """The real 512-token SentencePiece vocabulary (llama.cpp needs a vocab to load a file)."""
    import gguf

    reader = gguf.GGUFReader(STORIES_GGUF)
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


def write_gguf(path: Path, model, qtype, exclude: tuple[str, ...] = ()) -> None:
    """Every 2-D tensor in ``qtype`` (gguf-py quantizes it), norms in F32; tensors
    named in ``exclude`` (GGUF names) are left out."""
    import gguf

    config = model.config
    vocab = stories_vocab()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_scores(vocab["scores"])
    writer.add_token_types(vocab["types"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        if gguf_name(name) in exclude:
            continue
        array = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            array = permute_rows(array, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = permute_rows(array, config.num_key_value_heads)
        if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(array, dtype=np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name(name), array.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def dequantized_reference(path: Path, model):
    """The HF model with every weight replaced by gguf-py's dequantization of the file."""
    import gguf

    config = model.config
    by_gguf_name = {gguf_name(n): n for n in model.state_dict()}
    state = {}
    for tensor in gguf.GGUFReader(path).tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values = values.reshape([int(d) for d in reversed(tensor.shape)])
        name = by_gguf_name[tensor.name]
        if name.endswith("q_proj.weight"):
            values = unpermute_rows(values, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            values = unpermute_rows(values, config.num_key_value_heads)
        state[name] = torch.from_numpy(np.array(values, dtype=np.float32))
    reference = type(model)(config)
    reference.load_state_dict(state)
    return reference.eval()
