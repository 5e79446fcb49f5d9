"""llama.cpp's GGUF embedding models of arch ``bert`` (all-minilm, bge, mxbai-embed-large as
Ollama ships them) as an ``Encoder``, its pipeline and its tokenizer.

What llama.cpp's converter writes, and how it is read back here:

- Q, K and V as separate ``blk.N.attn_{q,k,v}`` tensors (or one ``attn_qkv``), fused at load;
  post-norm layers named ``attn_output_norm`` and ``layer_output_norm``. Every tensor type
  ``gguf_quants`` reads is dequantized to the model dtype at load (F32, F16, Q8_0, ...).
- ``token_types`` holds the segment embeddings; llama.cpp adds row 0 to every token (it runs no
  pairs), which is what our model does with the all-zero segment ids of a single text.
- ``<arch>.pooling_type`` is llama.cpp's enum (1 mean, 2 cls, 3 last); the vectors are
  normalized, as llama.cpp's embedding API and Ollama return them.
- The vocabulary is WordPiece's with llama.cpp's word-start convention: a word-start piece
  ``w`` is written ``▁w`` and a continuation ``##w`` as ``w``; control tokens stay as they
  are. Converted back, a ``tokenizers`` WordPiece with BERT's normalizer and pre-tokenizer
  gives the ids llama.cpp's tokenizer gives: [CLS] (``bos``), the words, [SEP].

The MLP runs transformers' exact GELU (the checkpoints were trained with it); llama.cpp uses
its tanh approximation, which moves the embeddings by about 1e-4.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers, processors

from ..errors import LocalserveError
from ..formats.gguf_file import GGUFFile, read_gguf
from ..formats.gguf_quants import gguf_to_weight
from ..kernels.quant_weight import QuantWeight, dequantize
from .config import EncoderConfig, check_config
from .model import Encoder
from .pipeline import Pipeline
from .tokenizer import EncoderTokenizer
from .weights import assemble, checked_state, rename

_POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's enum; 0 (none) and 4 (rank) make no embedding
_CONTROL = 3  # gguf TokenType.CONTROL: special tokens, written without the word-start mark
_WORD_START = "\u2581"

# llama.cpp tensor name -> ours; (ours, index) for pieces fused at load.
_TENSORS = [
    (r"token_embd\.weight", "word_embeddings.weight"),
    (r"position_embd\.weight", "position_embeddings.weight"),
    (r"token_types\.weight", "type_embeddings.weight"),
    (r"token_embd_norm\.(weight|bias)", r"embed_norm.\1"),
    (r"blk\.(\d+)\.attn_qkv\.(weight|bias)", r"layers.\1.qkv.\2"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", (r"layers.\1.qkv.\2", 0)),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", (r"layers.\1.qkv.\2", 1)),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", (r"layers.\1.qkv.\2", 2)),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", r"layers.\1.out.\2"),
    (r"blk\.(\d+)\.attn_output_norm\.(weight|bias)", r"layers.\1.attn_norm.\2"),
    (r"blk\.(\d+)\.ffn_up\.(weight|bias)", r"layers.\1.up.\2"),
    (r"blk\.(\d+)\.ffn_down\.(weight|bias)", r"layers.\1.down.\2"),
    (r"blk\.(\d+)\.layer_output_norm\.(weight|bias)", r"layers.\1.mlp_norm.\2"),
]
_COMPILED = [(re.compile(pattern), target) for pattern, target in _TENSORS]


def load_gguf_encoder(path: Path, dtype: torch.dtype) -> tuple[Encoder, Pipeline, EncoderTokenizer]:
    """The model (on the CPU, in ``dtype``), its pipeline and its tokenizer from a GGUF file."""
    with read_gguf(path) as gguf:
        try:
            config, pipeline = _config(gguf.metadata, path)
            tokenizer = EncoderTokenizer(_tokenizer(gguf.metadata), config.max_positions)
            with torch.device("meta"):
                model = Encoder(config)
            expected = {name: tensor.shape for name, tensor in model.state_dict().items()}
            model.load_state_dict(_state(gguf, config, expected, dtype), assign=True)
        except (KeyError, TypeError, ValueError) as exc:
            raise LocalserveError(f"{path}: missing or bad metadata value for {exc}") from None
        except LocalserveError as exc:
            raise LocalserveError(f"{path}: {exc}") from None
    return model, pipeline, tokenizer


def _config(meta: dict[str, Any], path: Path) -> tuple[EncoderConfig, Pipeline]:
    arch = meta.get("general.architecture")
    if arch != "bert":
        raise LocalserveError(f"GGUF arch {arch!r} is not an encoder localserve runs (bert is)")
    if meta.get(f"{arch}.attention.causal") is not False:
        raise LocalserveError(f"{arch}.attention.causal is not false: not a bidirectional encoder")
    pooling_type = meta.get(f"{arch}.pooling_type")
    if pooling_type not in _POOLING:
        raise LocalserveError(f"{arch}.pooling_type {pooling_type!r} is not an embedding pooling "
                              "(1 mean, 2 cls and 3 last are)")
    hidden, heads = int(meta[f"{arch}.embedding_length"]), int(meta[f"{arch}.attention.head_count"])
    if int(meta.get(f"{arch}.attention.head_count_kv", heads)) != heads:
        raise LocalserveError("grouped key/value heads are not supported in an encoder")
    positions = int(meta[f"{arch}.context_length"])
    config = check_config(EncoderConfig(
        family="bert", vocab_size=len(meta["tokenizer.ggml.tokens"]), hidden_size=hidden,
        num_layers=int(meta[f"{arch}.block_count"]), num_heads=heads, head_dim=hidden // heads if heads > 0 else 0,
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]), activation="gelu", gated_mlp=False,
        layer_norm_eps=float(meta[f"{arch}.attention.layer_norm_epsilon"]),
        type_vocab_size=int(meta.get("tokenizer.ggml.token_type_count", 1)), max_positions=positions,
        rope_theta=None, pad_token_id=int(meta.get("tokenizer.ggml.padding_token_id", 0)),
        attention_bias=True, up_bias=True, down_bias=True, num_labels=None))
    pipeline = Pipeline(task="embed", model_dir=path, pooling=_POOLING[pooling_type], normalize=True,
                        activation=None, max_length=positions, lowercase=False)
    return config, pipeline


def _tokenizer(meta: dict[str, Any]) -> HFTokenizer:
    if meta.get("tokenizer.ggml.model") != "bert":
        raise LocalserveError(f"tokenizer.ggml.model {meta.get('tokenizer.ggml.model')!r} is not bert (WordPiece)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise LocalserveError("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")
    vocab: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, types)):
        if kind != _CONTROL:
            token = token[1:] if token.startswith(_WORD_START) else f"##{token}"
        if vocab.setdefault(token, index) != index:  # llama.cpp refuses such a vocabulary too
            raise LocalserveError(f"the vocabulary has {tokens[index]!r} twice")

    def special(key: str, default: int) -> tuple[str, int]:
        # llama.cpp's defaults are BERT's ids (101 [CLS], 102 [SEP], 100 [UNK]).
        index = int(meta.get(f"tokenizer.ggml.{key}", default))
        if not 0 <= index < len(tokens):
            raise LocalserveError(f"tokenizer.ggml.{key} {index} is outside the vocabulary")
        return tokens[index], index

    (first, first_id), (sep, sep_id) = special("bos_token_id", 101), special("seperator_token_id", 102)
    unk = special("unknown_token_id", 100)[0]
    # llama.cpp's BERT normalizer: lowercase unless the file says not, accents stripped when lowercasing.
    lowercase = bool(meta.get("tokenizer.ggml.normalizer.lowercase", True))
    backend = HFTokenizer(models.WordPiece(vocab, unk_token=unk if unk in vocab else tokens[0],
                                           max_input_chars_per_word=1 << 30))  # llama.cpp has no word limit
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, lowercase=lowercase,
        strip_accents=bool(meta.get("tokenizer.ggml.normalizer.strip_accents", lowercase)))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{first} $A {sep}", special_tokens=[(first, first_id), (sep, sep_id)])
    return backend


def _state(gguf: GGUFFile, config: EncoderConfig, expected: dict[str, torch.Size],
           dtype: torch.dtype) -> dict[str, torch.Tensor]:
    def named() -> Iterator[tuple[str, int | None, torch.Tensor]]:
        for name, info in gguf.tensors.items():
            ours = rename(name, _COMPILED)
            if ours is None:
                raise LocalserveError(f"tensor {name} is not part of a bert embedding model")
            weight = gguf_to_weight(name, gguf.tensor_bytes(name), info.ggml_type, info.shape)
            yield *ours, dequantize(weight).view(info.shape) if isinstance(weight, QuantWeight) else weight

    state = assemble(named())
    # llama.cpp runs a model without token_types; adding a zero row is the same.
    state.setdefault("type_embeddings.weight", torch.zeros(expected["type_embeddings.weight"]))
    return checked_state(state, config, expected, dtype, "the metadata")
