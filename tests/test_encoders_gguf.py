"""llama.cpp's GGUF BERT embedding models (localserve/encoders/gguf.py): a tiny random BERT
sentence-transformers folder, written as GGUF the way llama.cpp's converter writes it (F32 and
Q8_0), embedded by us from both and by llama-cpp-python from the GGUF, and tokenized by both.

The folder is written here without transformers (whose import alone takes longer than these
tests): config.json, safetensors under BertModel's names, a tokenizer.json as BertTokenizer's
fast tokenizer saves it, and the sentence-transformers module files. Our reading of such folders
is checked against sentence-transformers itself in test_encoders.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from localserve.encoders.runner import EncoderModel
from localserve.errors import LocalserveError

gguf = pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp")

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from or had "
         "by hot word but what some we can out other were all there when up use your how said an each she which "
         "water people mother father earth house cafe naive resume number").split()
LETTERS = "abcdefghijklmnopqrstuvwxyz"
VOCAB = list(dict.fromkeys([*SPECIALS, *sorted(WORDS), *LETTERS, *".,!?'-", *(f"##{c}" for c in LETTERS), "##ing"]))
TEXTS = [
    "the boy said hello",
    "Water is wet.",
    "a",
    "Why do people like to play?!",
    "Café naïve RÉSUMÉ",  # accents stripped, uppercase lowered
    "zyx qwv mothers houses",  # continuation pieces
    "number 42, and 3.14 - or x2",  # digits are not in the vocabulary: [UNK] words
    "he said: 'the water; the earth'",
    "水 and ünknown-words",
]
HIDDEN, LAYERS, HEADS, FFN, POSITIONS = 32, 2, 4, 64, 40


def _bert_state(seed: int) -> dict[str, torch.Tensor]:
    """BertModel's tensors (no pooler), random and far from the init so every one shows."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"embeddings.word_embeddings.weight": (len(VOCAB), HIDDEN),
              "embeddings.position_embeddings.weight": (POSITIONS, HIDDEN),
              "embeddings.token_type_embeddings.weight": (2, HIDDEN),
              "embeddings.LayerNorm.weight": (HIDDEN,), "embeddings.LayerNorm.bias": (HIDDEN,)}
    for i in range(LAYERS):
        layer = f"encoder.layer.{i}."
        for part in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            shapes |= {f"{layer}{part}.weight": (HIDDEN, HIDDEN), f"{layer}{part}.bias": (HIDDEN,)}
        shapes |= {f"{layer}intermediate.dense.weight": (FFN, HIDDEN), f"{layer}intermediate.dense.bias": (FFN,),
                   f"{layer}output.dense.weight": (HIDDEN, FFN), f"{layer}output.dense.bias": (HIDDEN,)}
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes |= {f"{layer}{norm}.weight": (HIDDEN,), f"{layer}{norm}.bias": (HIDDEN,)}
    return {name: torch.randn(shape, generator=generator) * 0.2 + (name.endswith("LayerNorm.weight"))
            for name, shape in shapes.items()}


def _st_folder(path: Path, pooling: str) -> Path:
    """A sentence-transformers folder: Transformer, Pooling, Normalize."""
    path.mkdir()
    save_file(_bert_state(seed=1), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "bert", "architectures": ["BertModel"], "vocab_size": len(VOCAB), "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "intermediate_size": FFN, "hidden_act": "gelu",
        "max_position_embeddings": POSITIONS, "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0}))
    tokenizer = Tokenizer(models.WordPiece({t: i for i, t in enumerate(VOCAB)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                             special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": POSITIONS, "do_lower_case": False}))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": HIDDEN, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean"}))
    modules = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    (path / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": where, "type": f"sentence_transformers.models.{kind}"}
        for i, (where, kind) in enumerate(modules)]))
    return path


# BertModel name -> llama.cpp's (gguf-py's tensor name map for arch bert).
_NAMES = [("embeddings.word_embeddings", "token_embd"), ("embeddings.position_embeddings", "position_embd"),
          ("embeddings.token_type_embeddings", "token_types"), ("embeddings.LayerNorm", "token_embd_norm"),
          ("attention.self.query", "attn_q"), ("attention.self.key", "attn_k"), ("attention.self.value", "attn_v"),
          ("attention.output.dense", "attn_output"), ("attention.output.LayerNorm", "attn_output_norm"),
          ("intermediate.dense", "ffn_up"), ("output.dense", "ffn_down"), ("output.LayerNorm", "layer_output_norm")]


def _gguf_name(name: str) -> str:
    if name.startswith("encoder.layer."):
        _, _, index, rest = name.split(".", 3)
        return f"blk.{index}.{_gguf_name(rest)}"
    for ours, theirs in _NAMES:
        if name.startswith(ours + "."):
            return theirs + name[len(ours):]
    raise AssertionError(name)


def _write_gguf(folder: Path, out: Path, pooling: str, q8: bool, drop: str = "", pooling_type: int | None = None,
                reshape: str = "") -> Path:
    """The folder as llama.cpp's converter (BertModel, --outtype f32 or q8_0) writes it: its
    keys, the vocabulary with the word-start mark, norms/biases/positions/token types in F32."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out), "bert")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.ALL_F32)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(pooling_type) if pooling_type is not None else
                            {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS}[pooling])
    tokens = (folder / "vocab.txt").read_text().splitlines()
    types = [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens]
    writer.add_token_type_count(config["type_vocab_size"])
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t if k == gguf.TokenType.CONTROL else t[2:] if t.startswith("##") else "\u2581" + t
                           for t, k in zip(tokens, types)])
    writer.add_token_types(types)
    # gguf.SpecialVocab on BertTokenizer's files: bos/eos fall back to cls/sep.
    ids = {t: tokens.index(t) for t in SPECIALS}
    writer.add_bos_token_id(ids["[CLS]"])
    writer.add_eos_token_id(ids["[SEP]"])
    writer.add_unk_token_id(ids["[UNK]"])
    writer.add_sep_token_id(ids["[SEP]"])
    writer.add_pad_token_id(ids["[PAD]"])
    writer.add_mask_token_id(ids["[MASK]"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    writer.add_bool("tokenizer.ggml.normalizer.lowercase", True)  # BertNormalizer's (this gguf-py has no add_ for it)
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        new_name = _gguf_name(name)
        if new_name == drop:
            continue
        data = tensor.numpy().astype(np.float32)
        if new_name == reshape:
            data = data[:-1]
        if q8 and data.ndim == 2 and new_name.endswith(".weight") and \
                not new_name.startswith(("position_embd", "token_types")):
            writer.add_tensor(new_name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(new_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders-gguf")
    made: dict[str, Path] = {}
    for pooling in ("mean", "cls"):
        folder = made[pooling] = _st_folder(root / pooling, pooling)
        made[f"{pooling}-f32"] = _write_gguf(folder, root / f"{pooling}-f32.gguf", pooling, q8=False)
    made["mean-q8_0"] = _write_gguf(made["mean"], root / "mean-q8_0.gguf", "mean", q8=True)
    return made


def _llama(path: Path):
    return llama_cpp.Llama(model_path=str(path), embedding=True, n_ctx=64, n_batch=64, n_ubatch=64, n_threads=2,
                           verbose=False)


def _llama_embed(path: Path) -> torch.Tensor:
    """llama.cpp's embeddings of TEXTS, pooled as the file says and normalized (what Ollama returns)."""
    return torch.tensor(_llama(path).embed(TEXTS, normalize=True))


def test_token_ids_equal_llama_cpp(files: dict[str, Path]) -> None:
    ours = EncoderModel.load(files["mean-f32"]).tokenizer.encode(TEXTS)
    llama = _llama(files["mean-f32"])
    for text, encoded in zip(TEXTS, ours):
        assert encoded.ids == llama.tokenize(text.encode(), add_bos=True, special=False), text
    # The folder's own WordPiece tokenizer agrees too: the word-start mark converts back losslessly.
    assert [e.ids for e in EncoderModel.load(files["mean"]).tokenizer.encode(TEXTS)] == [e.ids for e in ours]


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_f32_equals_folder_and_llama_cpp(files: dict[str, Path], pooling: str) -> None:
    model = EncoderModel.load(files[f"{pooling}-f32"])
    assert model.pipeline.pooling == pooling and model.pipeline.normalize
    inputs = [e.ids for e in model.tokenizer.encode(TEXTS)]
    ours = model.embed(inputs)
    torch.testing.assert_close(ours, EncoderModel.load(files[pooling]).embed(inputs), rtol=0, atol=1e-5)
    # llama.cpp's GELU is the tanh approximation looked up in an fp16 table, where the checkpoint's (and
    # ours) is exact erf: up to ~1e-3 on an activation, which on these unit vectors measures ~1e-4.
    theirs = _llama_embed(files[f"{pooling}-f32"])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-3)


def test_q8_0(files: dict[str, Path]) -> None:
    model = EncoderModel.load(files["mean-q8_0"])
    inputs = [e.ids for e in model.tokenizer.encode(TEXTS)]
    ours = model.embed(inputs)
    # Q8_0 rounds each weight by up to half a step of max|w|/127 per 32: the vectors move ~5e-3.
    folder = EncoderModel.load(files["mean"]).embed(inputs)
    assert (ours - folder).abs().max() < 1e-2 and (ours * folder).sum(-1).min() > 0.9995
    # llama.cpp also rounds the activations to 8 bits per 32 before each quantized matmul.
    theirs = _llama_embed(files["mean-q8_0"])
    # That rounding is not in ours (we dequantize at load), so ours and theirs differ as much as from the
    # folder; the same bound shows both read the same quantized weights.
    assert (ours - theirs).abs().max() < 1e-2 and (ours * theirs).sum(-1).min() > 0.9995


@pytest.mark.parametrize(("change", "message"), [
    (dict(drop="blk.1.ffn_down.weight"), "missing tensor for layers.1.down.weight"),
    (dict(reshape="blk.0.ffn_up.weight"), "layers.0.up.weight is [63, 32], the metadata says [64, 32]"),
    (dict(pooling_type=4), "bert.pooling_type 4 is not an embedding pooling"),
])
def test_malformed_file(files: dict[str, Path], tmp_path: Path, change: dict, message: str) -> None:
    path = _write_gguf(files["mean"], tmp_path / "bad.gguf", "mean", q8=False, **change)
    with pytest.raises(LocalserveError) as error:
        EncoderModel.load(path)
    assert message in str(error.value) and "\n" not in str(error.value)
