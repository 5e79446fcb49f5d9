"""An encoder's safetensors weights under model.py's names, checked against the config.

Checkpoint names differ by family and by the class that saved them: a bare encoder
(BertModel: ``encoder.layer.0...``), a classifier's (``bert.``/``roberta.`` before the
same names, its head beside them), nomic's own (``encoder.layers.0.attn.Wqkv``, ``fc11``).
Q, K and V are fused into one matrix, as are nomic's gate (``fc12``) and up (``fc11``)
projections. Tensors the task never uses (a pooler or MLM head beside an embedding model,
the ``position_ids`` buffer old checkpoints saved) are skipped; any other unknown tensor is
an error, as it would mean a model we would compute wrong.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ..errors import LocalserveError
from ..formats.hf import shard_files
from ..formats.weights import safetensors_tensors
from .config import EncoderConfig

_PREFIXES = ("bert.", "roberta.", "nomic_bert.", "model.")
_SKIPPED = re.compile(r"(embeddings\.position_ids|cls\..*|lm_head\..*)")

# BERT / RoBERTa checkpoint name -> ours; (part, index) for pieces that are fused.
_BERT = [
    (r"embeddings\.word_embeddings\.weight", "word_embeddings.weight"),
    (r"embeddings\.position_embeddings\.weight", "position_embeddings.weight"),
    (r"embeddings\.token_type_embeddings\.weight", "type_embeddings.weight"),
    (r"embeddings\.LayerNorm\.(weight|bias)", r"embed_norm.\1"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.query\.(weight|bias)", (r"layers.\1.qkv.\2", 0)),
    (r"encoder\.layer\.(\d+)\.attention\.self\.key\.(weight|bias)", (r"layers.\1.qkv.\2", 1)),
    (r"encoder\.layer\.(\d+)\.attention\.self\.value\.(weight|bias)", (r"layers.\1.qkv.\2", 2)),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)", r"layers.\1.out.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.(weight|bias)", r"layers.\1.attn_norm.\2"),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)", r"layers.\1.up.\2"),
    (r"encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)", r"layers.\1.down.\2"),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.(weight|bias)", r"layers.\1.mlp_norm.\2"),
]
_BERT_HEAD = [(r"pooler\.dense\.(weight|bias)", r"head.dense.\1"), (r"classifier\.(weight|bias)", r"head.out.\1")]
_ROBERTA_HEAD = [(r"classifier\.dense\.(weight|bias)", r"head.dense.\1"),
                 (r"classifier\.out_proj\.(weight|bias)", r"head.out.\1")]
_NOMIC = [
    (r"embeddings\.word_embeddings\.weight", "word_embeddings.weight"),
    (r"embeddings\.token_type_embeddings\.weight", "type_embeddings.weight"),
    (r"emb_ln\.(weight|bias)", r"embed_norm.\1"),
    (r"encoder\.layers\.(\d+)\.attn\.Wqkv\.(weight|bias)", r"layers.\1.qkv.\2"),
    (r"encoder\.layers\.(\d+)\.attn\.out_proj\.(weight|bias)", r"layers.\1.out.\2"),
    (r"encoder\.layers\.(\d+)\.norm1\.(weight|bias)", r"layers.\1.attn_norm.\2"),
    (r"encoder\.layers\.(\d+)\.mlp\.fc12\.(weight|bias)", (r"layers.\1.up.\2", 0)),  # the gate
    (r"encoder\.layers\.(\d+)\.mlp\.fc11\.(weight|bias)", (r"layers.\1.up.\2", 1)),
    (r"encoder\.layers\.(\d+)\.mlp\.fc2\.(weight|bias)", r"layers.\1.down.\2"),
    (r"encoder\.layers\.(\d+)\.norm2\.(weight|bias)", r"layers.\1.mlp_norm.\2"),
]
_PIECES = {"qkv": 3, "up": 2}  # fused matrices and their piece counts (up only when gated)


def load_state(model_dir: Path, config: EncoderConfig, expected: dict[str, torch.Size],
               dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's full state dict (names and shapes as ``expected``), in ``dtype``."""
    table = _table(config)

    def named() -> Iterator[tuple[str, int | None, torch.Tensor]]:
        for name, tensor in safetensors_tensors(shard_files(model_dir)):
            canonical = _canonical(name)
            ours = rename(canonical, table)
            if ours is None:
                if _SKIPPED.fullmatch(canonical) or (not config.classifies and canonical.startswith("pooler.")):
                    continue
                raise LocalserveError(f"tensor {name} is not part of a {config.family} "
                                      f"{'reranker' if config.classifies else 'encoder'}")
            yield *ours, tensor

    try:
        return checked_state(assemble(named()), config, expected, dtype)
    except LocalserveError as exc:
        raise LocalserveError(f"{model_dir}: {exc}") from None


def assemble(named: Iterable[tuple[str, int | None, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Our state from (our name, piece index or None, tensor): a fused matrix's pieces
    joined in order, each complete and of one width; a name given twice is refused."""
    state: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for target, index, tensor in named:
        if target in state or (index is None and target in pieces) or index in pieces.get(target, {}):
            raise LocalserveError(f"two tensors give {target}")
        if index is None:
            state[target] = tensor
        else:
            pieces.setdefault(target, {})[index] = tensor
    for target, parts in pieces.items():
        count = _PIECES[target.split(".")[-2]]
        if sorted(parts) != list(range(count)):
            raise LocalserveError(f"{target} is missing {count - len(parts)} of its {count} parts")
        if len({part.shape[1:] for part in parts.values()}) != 1:
            raise LocalserveError(f"the parts of {target} differ in shape")
        state[target] = torch.cat([parts[i] for i in range(count)])
    return state


def checked_state(state: dict[str, torch.Tensor], config: EncoderConfig, expected: dict[str, torch.Size],
                  dtype: torch.dtype, source: str = "the config") -> dict[str, torch.Tensor]:
    """``state`` once every tensor the model has is there, of the shape ``source`` (where the
    sizes came from) says, in ``dtype``."""
    missing = sorted(set(expected) - set(state))
    if missing:
        raise LocalserveError(f"missing tensor{'s' if len(missing) > 1 else ''} for "
                              f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} ({source} and "
                              "the weights disagree)")
    for name, tensor in state.items():
        if name not in expected:
            raise LocalserveError(f"tensor for {name} is not part of this config's model "
                                  f"(it has {config.num_layers} layers)")
        if tensor.shape != expected[name]:
            raise LocalserveError(f"{name} is {list(tensor.shape)}, {source} says {list(expected[name])}")
        if not tensor.is_floating_point():
            raise LocalserveError(f"{name} holds {tensor.dtype}, not floating-point weights")
        state[name] = tensor.to(dtype)
    return state


def _table(config: EncoderConfig) -> list[tuple[re.Pattern[str], str | tuple[str, int]]]:
    if config.family == "nomic_bert":
        rows = _NOMIC
    else:
        head = _BERT_HEAD if config.family == "bert" else _ROBERTA_HEAD
        rows = _BERT + (head if config.classifies else [])
    return [(re.compile(pattern), target) for pattern, target in rows]


def _canonical(name: str) -> str:
    """A checkpoint name without its model-class prefix; old checkpoints converted from
    TensorFlow call layer-norm parameters gamma and beta."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    return re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", name))


def rename(name: str, table: list[tuple[re.Pattern[str], str | tuple[str, int]]]) -> tuple[str, int | None] | None:
    """(our name, piece index or None) for a canonical name; None when it is no weight of ours."""
    for pattern, target in table:
        match = pattern.fullmatch(name)
        if match is None:
            continue
        if isinstance(target, tuple):
            return match.expand(target[0]), target[1]
        return match.expand(target), None
    return None
