"""The tiny Gemma 3 image-text checkpoint of tests/vision_util.py written as llama.cpp
keeps such a model: a ``gemma3`` GGUF text model and an ``mmproj`` projector file (arch
``clip``), with gguf-py, laid out as llama.cpp's converter lays them out (its
``Gemma3Model`` and ``Gemma3VisionModel``: norms stored as 1 + w, the projector's input
projection in F16 and as HF shapes it, SigLIP's tensors under ``v.*``, fc1 as ffn_up); the
tiny Qwen2.5-VL and Qwen3-VL checkpoints of tests/test_vision_qwen_engine.py likewise
(``write_qwen25vl_pair``, ``write_qwen3vl_pair``).

The text model's vocabulary is the tiny tokenizer's own (a ``gpt2`` BPE vocabulary: its
pieces byte-level encoded, its merges, the special tokens as control tokens), so the ids
are the HF checkpoint's and llama.cpp can tokenize the prompts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .gguf_writers import gguf_tensors
from .vision_util import GEMMA3_TEMPLATE, SPECIAL_TOKENS, VOCAB, _vocabulary

# llama.cpp's converter: the projector's input projection is always F16, patch and
# position embeddings F32 (its tensor_force_quant), the rest at the file's type.
_FORCED_F16 = ("mm.input_projection.weight",)
_FORCED_F32 = ("v.patch_embd.weight", "v.position_embd.weight")


def _byte_level() -> dict[int, str]:
    """GPT-2's byte -> character table (printable bytes stand for themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _encoded(piece: str) -> str:
    table = _byte_level()
    return "".join(table[byte] for byte in piece.encode("utf-8"))


def text_model_state(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The checkpoint's text config and its language model's tensors under a causal
    LM's names (``model.layers...``)."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    state = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        for prefix in ("model.language_model.", "language_model.model."):
            if name.startswith(prefix):
                state["model." + name.removeprefix(prefix)] = tensor
    return config, state


def write_text_gguf(folder: Path, path: Path) -> None:
    """The checkpoint's text model as a ``gemma3`` GGUF, all in F32, with its vocabulary."""
    import gguf
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config, state = text_model_state(folder)
    text = Gemma3TextConfig(**config["text_config"])
    model = Gemma3ForCausalLM(text)
    model.load_state_dict(state, strict=False)  # lm_head is tied to the embeddings
    writer = gguf.GGUFWriter(str(path), "gemma3")
    head_dim = text.head_dim
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_block_count(text.num_hidden_layers)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(text.num_attention_heads)
    writer.add_head_count_kv(text.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    rope = text.rope_parameters or {}
    writer.add_rope_freq_base(float(rope.get("full_attention", rope).get("rope_theta", 1e6)))
    writer.add_sliding_window(text.sliding_window)
    _gpt2_vocabulary(writer, SPECIAL_TOKENS, VOCAB)
    writer.add_bos_token_id(next(t for t, text in SPECIAL_TOKENS.items() if text == "<bos>"))
    writer.add_eos_token_id(next(t for t, text in SPECIAL_TOKENS.items() if text == "<eos>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(GEMMA3_TEMPLATE.read_text(encoding="utf-8"))
    for name, array in gguf_tensors(model.eval()).items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    _finish(writer)


def write_mmproj(folder: Path, path: Path, matrices: str = "F32") -> None:
    """The checkpoint's vision tower and projector as llama.cpp's projector file; the
    tower's matrices in ``matrices`` (F32, F16 or Q8_0), the rest as the converter forces."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    vision = config["vision_config"]
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(config["text_config"]["hidden_size"])
    writer.add_vision_image_size(vision["image_size"])
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["num_hidden_layers"])
    writer.add_vision_head_count(vision["num_attention_heads"])
    writer.add_vision_image_mean([0.5, 0.5, 0.5])
    writer.add_vision_image_std([0.5, 0.5, 0.5])
    writer.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-6))
    writer.add_vision_use_gelu(True)
    side = vision["image_size"] // vision["patch_size"]
    writer.add_vision_projector_scale_factor(side // int(config["mm_tokens_per_image"] ** 0.5))
    for name, tensor in load_file(folder / "model.safetensors").items():
        gguf_name = _projector_name(name)
        if gguf_name is None:
            continue
        array = tensor.float().numpy()
        if gguf_name == "mm.soft_emb_norm.weight":
            array = array + 1
        if gguf_name in _FORCED_F16:
            writer.add_tensor(gguf_name, array.astype(np.float16))
        elif gguf_name in _FORCED_F32:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
        else:
            _add_tensor(writer, gguf_name, array, matrices)
    _finish(writer)


def _add_tensor(writer, name: str, array: np.ndarray, matrices: str) -> None:  # type: ignore[no-untyped-def]
    """A vector in F32, a matrix in ``matrices`` (F32, F16 or a quantized type such as Q8_0)."""
    import gguf

    if array.ndim == 1 or matrices == "F32":
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    elif matrices == "F16":
        writer.add_tensor(name, array.astype(np.float16))
    else:
        kind = gguf.GGMLQuantizationType[matrices]
        writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), kind),
                          raw_dtype=kind)


_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.out_proj": "attn_out", "layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_up",
          "mlp.fc2": "ffn_down"}


def _projector_name(name: str) -> str | None:
    """llama.cpp's name for an HF tensor of the vision side (None: the text model's)."""
    for prefix in ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                   "vision_tower."):  # released files, then transformers 5's
        if name.startswith(prefix):
            rest = name.removeprefix(prefix)
            if rest.startswith("embeddings.patch_embedding."):
                return "v.patch_embd." + rest.rsplit(".", 1)[1]
            if rest == "embeddings.position_embedding.weight":
                return "v.position_embd.weight"
            if rest.startswith("post_layernorm."):
                return "v.post_ln." + rest.rsplit(".", 1)[1]
            parts = rest.split(".")  # encoder.layers.N.<module>.<kind>
            return f"v.blk.{parts[2]}.{_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"
    for prefix in ("model.multi_modal_projector.", "multi_modal_projector."):
        if name.startswith(prefix):
            return {"mm_input_projection_weight": "mm.input_projection.weight",
                    "mm_soft_emb_norm.weight": "mm.soft_emb_norm.weight"}[name.removeprefix(prefix)]
    return None


def _finish(writer) -> None:  # type: ignore[no-untyped-def]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def rewrite_gguf(source: Path, target: Path, arch: str | None = None, drop: tuple[str, ...] = (),
                 extra: dict[str, list[int]] | None = None) -> None:
    """``source`` copied to ``target`` but for the keys and tensors named in ``drop``: under
    ``arch`` (its ``<arch>.`` keys renamed), with the integer arrays of ``extra`` added."""
    import gguf

    reader = gguf.GGUFReader(source)
    old_arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch or old_arch)
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture" and name not in drop:
            main = field.types[0]
            key = f"{arch}.{name.removeprefix(old_arch + '.')}" if arch and name.startswith(old_arch + ".") else name
            writer.add_key_value(key, field.contents(), main,
                                 sub_type=field.types[-1] if main == gguf.GGUFValueType.ARRAY else None)
    for key, values in (extra or {}).items():
        writer.add_array(key, values)
    for tensor in reader.tensors:
        if tensor.name not in drop:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    _finish(writer)


def gguf_pair(hf_folder: Path, target: Path, matrices: str = "F32") -> Path:
    """A folder ``target`` holding the GGUF model and its projector file, as a pull of
    such a repository stores them."""
    target.mkdir(parents=True)
    write_text_gguf(hf_folder, target / "tiny-gemma3.gguf")
    write_mmproj(hf_folder, target / f"mmproj-tiny-gemma3-{matrices.lower()}.gguf", matrices)
    return target


def llama_cpp_generate(model: Path, projector: Path, text: str, images: list[bytes], max_tokens: int,
                       ) -> tuple[list[int], list[np.ndarray]]:
    """llama.cpp's greedy tokens for ``text`` with ``images`` at its media markers
    (``mtmd_default_marker``), through its own multimodal library (libmtmd, as llama-server
    runs it), and each image's embeddings as its projector made them. The images must be
    at the projector's size already (llama.cpp resizes with its own bilinear filter)."""
    import ctypes
    import io

    from llama_cpp import Llama
    from llama_cpp import llama_cpp as lc
    from llama_cpp import mtmd_cpp as mtmd
    from PIL import Image

    llm = Llama(model_path=str(model), n_ctx=512, n_threads=2, verbose=False)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.warmup, params.print_timings = False, 2, False, False
    context = mtmd.mtmd_init_from_file(str(projector).encode(), llm._model.model, params)
    assert context, "llama.cpp could not open the projector"
    bitmaps, chunks = [], mtmd.mtmd_input_chunks_init()
    try:
        for data in images:
            image = Image.open(io.BytesIO(data)).convert("RGB")
            pixels = np.asarray(image, dtype=np.uint8).tobytes()
            bitmaps.append(mtmd.mtmd_bitmap_init(image.width, image.height,
                                                 (ctypes.c_uint8 * len(pixels)).from_buffer_copy(pixels)))
        encoded = text.encode()
        request = mtmd.mtmd_input_text(text=encoded, text_len=len(encoded), add_special=False, parse_special=True)
        assert mtmd.mtmd_tokenize(context, chunks, ctypes.byref(request),
                                  (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps), len(bitmaps)) == 0
        embeddings = []
        width = lc.llama_model_n_embd_inp(llm._model.model)  # Qwen3-VL's: the text model's times 1 + deepstack layers
        for index in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, index)
            if mtmd.mtmd_input_chunk_get_type(chunk) != 0:  # an image
                count = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
                assert mtmd.mtmd_encode_chunk(context, chunk) == 0
                output = mtmd.mtmd_get_output_embd(context)
                embeddings.append(np.ctypeslib.as_array(output, shape=(count * width,)).reshape(count, width).copy())
        position = lc.llama_pos(0)
        assert mtmd.mtmd_helper_eval_chunks(context, llm.ctx, chunks, 0, 0, 512, True, ctypes.byref(position)) == 0
        tokens: list[int] = []
        vocab = llm.n_vocab()
        for _ in range(max_tokens):
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
            tokens.append(int(np.argmax(logits)))
            batch = (lc.llama_token * 1)(tokens[-1])
            assert lc.llama_decode(llm.ctx, lc.llama_batch_get_one(batch, 1)) == 0
        return tokens, embeddings
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        for bitmap in bitmaps:
            mtmd.mtmd_bitmap_free(bitmap)
        mtmd.mtmd_free(context)
        llm.close()


# -- Qwen2.5-VL and Qwen3-VL: a qwen2vl / qwen3vl text model and a qwen2.5vl_merger / qwen3vl_merger projector ---

def _gpt2_vocabulary(writer, special_tokens: dict[int, str], size: int) -> None:  # type: ignore[no-untyped-def]
    """The tiny tokenizer's vocabulary as a GGUF ``gpt2`` one (byte-level pieces)."""
    import gguf

    vocab, merges = _vocabulary(special_tokens, size)
    pieces = sorted(vocab, key=vocab.__getitem__)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([piece if vocab[piece] in special_tokens else _encoded(piece) for piece in pieces])
    writer.add_token_types([gguf.TokenType.CONTROL if vocab[piece] in special_tokens else gguf.TokenType.NORMAL
                            for piece in pieces])
    writer.add_token_merges([f"{_encoded(left)} {_encoded(right)}" for left, right in merges])


def _write_qwen_text(hf_folder: Path, path: Path, arch: str, special_tokens: dict[int, str], size: int,
                     template: str, eos: int) -> None:
    """The checkpoint's text model as the converter writes a Qwen-VL's: arch ``qwen2vl``
    (Qwen2's tensors) or ``qwen3vl`` (Qwen3's, its head size and the number of deepstack
    layers stated), the M-RoPE sections padded to four (``rope.dimension_sections``)."""
    import gguf
    from safetensors.torch import load_file

    from .gguf_writers import gguf_name

    config = json.loads((hf_folder / "config.json").read_text())
    text = config["text_config"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(text.get("rms_norm_eps", 1e-6))
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", text.get("rope_theta", 10000.0))))
    writer.add_rope_dimension_sections([*rope["mrope_section"], 0])
    if arch == "qwen3vl":
        writer.add_key_length(text["head_dim"])
        writer.add_value_length(text["head_dim"])
        writer.add_num_deepstack_layers(len(config["vision_config"]["deepstack_visual_indexes"]))
    _gpt2_vocabulary(writer, special_tokens, size)
    writer.add_eos_token_id(eos)
    writer.add_add_bos_token(False)
    writer.add_chat_template(template)
    for name, tensor in load_file(hf_folder / "model.safetensors").items():
        for prefix in ("model.language_model.", "model."):
            if name.startswith(prefix) and not name.startswith("model.visual."):
                name = "model." + name.removeprefix(prefix)
                break
        else:
            if not name.startswith("lm_head."):
                continue
        writer.add_tensor(gguf_name(name, arch), np.ascontiguousarray(tensor.float().numpy()))
    _finish(writer)


def _qwen_projector(hf_folder: Path, path: Path, kind, image_size: int):  # type: ignore[no-untyped-def]
    """A projector file's writer with the keys the converter writes for every Qwen-VL
    (``image_size``: what it states for a tower that keeps each image's own size), and
    the checkpoint's vision tensors below ``visual.`` as float32 arrays."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_folder / "config.json").read_text())
    vision = config["vision_config"]
    preprocessor = json.loads((hf_folder / "preprocessor_config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_clip_projector_type(kind)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(config["text_config"]["hidden_size"])
    writer.add_vision_image_size(image_size)
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["depth"])
    writer.add_vision_head_count(vision["num_heads"])
    writer.add_vision_image_mean(preprocessor["image_mean"])
    writer.add_vision_image_std(preprocessor["image_std"])
    # The converter writes the text model's epsilon as the tower's.
    writer.add_vision_attention_layernorm_eps(config["text_config"].get("rms_norm_eps", 1e-6))
    tensors = {name.split("visual.", 1)[1]: np.ascontiguousarray(tensor.float().numpy())
               for name, tensor in load_file(hf_folder / "model.safetensors").items()
               if name.startswith(("visual.", "model.visual."))}
    return writer, config, tensors


def _add_patch_kernels(writer, array: np.ndarray) -> None:  # type: ignore[no-untyped-def]
    """The Conv3d's kernel ``[out, in, frames, h, w]`` as one 2-D kernel per frame."""
    writer.add_tensor("v.patch_embd.weight", np.ascontiguousarray(array[:, :, 0]))
    writer.add_tensor("v.patch_embd.weight.1", np.ascontiguousarray(array[:, :, 1]))


def write_qwen25vl_pair(hf_folder: Path, target: Path, special_tokens: dict[int, str], size: int,
                        template: str, eos: int, matrices: str = "F32") -> Path:
    """The tiny Qwen2.5-VL checkpoint as llama.cpp's converter writes it: the text model as
    arch ``qwen2vl`` and the tower as a ``qwen2.5vl_merger`` projector (q/k/v split from the
    fused projection, the Conv3d's two frames as two kernels, every ``n_wa_pattern``-th block
    attending across the image; the linear layers' matrices in ``matrices``)."""
    import gguf

    target.mkdir(parents=True)
    _write_qwen_text(hf_folder, target / "tiny-qwen25vl.gguf", "qwen2vl", special_tokens, size, template, eos)
    writer, config, tensors = _qwen_projector(hf_folder, target / f"mmproj-tiny-qwen25vl-{matrices.lower()}.gguf",
                                              gguf.VisionProjectorType.QWEN25VL, 560)  # the converter's stand-in
    writer.add_vision_use_silu(True)
    writer.add_vision_n_wa_pattern(config["vision_config"]["fullatt_block_indexes"][0] + 1)
    layer = {"attn.proj": "attn_out", "norm1": "ln1", "norm2": "ln2", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, array in tensors.items():
        if name == "patch_embed.proj.weight":
            _add_patch_kernels(writer, array)
        elif name.startswith("merger.ln_q."):
            writer.add_tensor("v.post_ln." + name.rsplit(".", 1)[1], array)
        elif name.startswith("merger.mlp."):
            _add_tensor(writer, "mm." + name.removeprefix("merger.mlp."), array, matrices)
        else:
            parts = name.split(".")  # blocks.N.<module>.<kind>
            block, module, kind = parts[1], ".".join(parts[2:-1]), parts[-1]
            if module == "attn.qkv":
                for piece, chunk in zip(("attn_q", "attn_k", "attn_v"), np.split(array, 3, axis=0)):
                    _add_tensor(writer, f"v.blk.{block}.{piece}.{kind}", chunk, matrices)
            else:
                _add_tensor(writer, f"v.blk.{block}.{layer[module]}.{kind}", array, matrices)
    _finish(writer)
    return target


def write_qwen3vl_pair(hf_folder: Path, target: Path, special_tokens: dict[int, str], size: int,
                       template: str, eos: int) -> Path:
    """The tiny Qwen3-VL checkpoint as llama.cpp's converter writes it (its Qwen3VLTextModel
    and Qwen3VLVisionModel): the text model as arch ``qwen3vl`` and the tower as a
    ``qwen3vl_merger`` projector (q/k/v fused, the Conv3d's two frames as two kernels and its
    bias, the main merger as ``v.post_ln``, ``mm.0``, ``mm.2``, each deepstack merger under
    the number of the block it reads, ``v.deepstack.<block>.{norm,fc1,fc2}``)."""
    import gguf

    target.mkdir(parents=True)
    _write_qwen_text(hf_folder, target / "tiny-qwen3vl.gguf", "qwen3vl", special_tokens, size, template, eos)
    path = target / "mmproj-tiny-qwen3vl-f32.gguf"
    vision = json.loads((hf_folder / "config.json").read_text())["vision_config"]
    # The converter's image size: the learned position grid's side in pixels.
    image_size = int(vision["num_position_embeddings"] ** 0.5 * vision["patch_size"])
    writer, _, tensors = _qwen_projector(hf_folder, path, gguf.VisionProjectorType.QWEN3VL, image_size)
    writer.add_vision_use_gelu(True)
    writer.add_vision_spatial_merge_size(vision["spatial_merge_size"])
    blocks = vision["deepstack_visual_indexes"]
    writer.add_vision_is_deepstack_layers([block in blocks for block in range(vision["depth"])])
    layer = {"attn.qkv": "attn_qkv", "attn.proj": "attn_out", "norm1": "ln1", "norm2": "ln2",
             "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}
    merger = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
    deepstack = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}
    for name, array in tensors.items():
        parts = name.split(".")
        if name == "patch_embed.proj.weight":
            _add_patch_kernels(writer, array)
        elif name == "patch_embed.proj.bias":
            writer.add_tensor("v.patch_embd.bias", array)
        elif name == "pos_embed.weight":
            writer.add_tensor("v.position_embd.weight", array)
        elif parts[0] == "merger":  # merger.<module>.<kind>
            writer.add_tensor(f"{merger[parts[1]]}.{parts[2]}", array)
        elif parts[0] == "deepstack_merger_list":  # deepstack_merger_list.I.<module>.<kind>
            writer.add_tensor(f"v.deepstack.{blocks[int(parts[1])]}.{deepstack[parts[2]]}.{parts[3]}", array)
        else:  # blocks.N.<module>.<kind>
            writer.add_tensor(f"v.blk.{parts[1]}.{layer['.'.join(parts[2:-1])]}.{parts[-1]}", array)
    _finish(writer)
    return target
