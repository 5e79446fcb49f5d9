"""Checkpoint readers: every on-disk format becomes a ModelSpec plus named weights."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..text.chat_template import ChatTemplate
from ..errors import LocalserveError
from ..text.gguf_tokenizer import tokenizer_from_gguf_metadata
from ..kernels.quant_linear import QuantWeight
from ..text.tokenizer import Tokenizer
from . import hf
from .gguf import ROPE_FREQS, chat_template_from_gguf, iter_gguf_weights, spec_from_gguf
from .gguf_file import GGUFFile, read_gguf
from .gguf_quants import loaded_nbytes
from .hf_quant import QuantConfig, convert_quantized, quant_config_from
from .spec import ModelSpec, RopeSpec

NamedWeight = tuple[str, torch.Tensor | QuantWeight]


@dataclass(slots=True, frozen=True)
class TensorSize:
    name: str  # as in the file
    parameters: int  # model weights it holds (0 for quantization metadata)
    file_bytes: int
    loaded_bytes: int  # once loaded by localserve


@dataclass(slots=True)
class Checkpoint:
    """A checkpoint's description; weights are read when ``weights()`` is iterated."""

    path: Path
    spec: ModelSpec
    files: list[Path]  # HF safetensors shards (empty for GGUF)
    quant: QuantConfig | None = None  # GPTQ/AWQ layers come out as QuantWeights
    gguf: GGUFFile | None = None  # the parsed file, for .gguf checkpoints

    def weights(self) -> Iterator[NamedWeight]:
        if self.gguf is not None:
            return iter_gguf_weights(self.gguf, self.spec)
        tensors = hf.iter_tensors(self.files)
        return convert_quantized(tensors, self.quant) if self.quant else tensors

    def tensor_sizes(self, dtype: torch.dtype) -> Iterator[TensorSize]:
        """Every tensor's parameters and bytes, from the file headers alone (no weights
        are read); ``loaded_bytes`` assumes unquantized tensors become ``dtype``."""
        item_bytes = torch.empty((), dtype=dtype).element_size()
        if self.gguf is not None:
            for info in self.gguf.tensors.values():
                if info.name == ROPE_FREQS:
                    continue
                loaded = loaded_nbytes(info.name, info.ggml_type, info.shape, item_bytes)
                yield TensorSize(info.name, info.n_elements, self.gguf.tensor_nbytes(info.name), loaded)
            return
        for name, shape, stored in hf.tensor_headers(self.files):
            if name == "lm_head.weight" and self.spec.tie_word_embeddings:
                continue  # the embeddings serve as the head
            if stored not in hf.SAFETENSORS_ITEM_BYTES:
                raise LocalserveError(f"tensor {name!r} has safetensors dtype {stored}, which localserve cannot load")
            numel = math.prod(shape)
            file_bytes = numel * hf.SAFETENSORS_ITEM_BYTES[stored]
            floating = stored.startswith(("F", "BF"))
            # GPTQ/AWQ integer tensors keep their size (codes stay packed). A qweight word
            # holds 32 / bits weights; scales, qzeros and g_idx are quantization metadata.
            if self.quant is not None and name.endswith(".qweight"):
                parameters = numel * 32 // self.quant.bits
            elif floating and not (self.quant is not None and name.endswith(".scales")):
                parameters = numel
            else:
                parameters = 0
            yield TensorSize(name, parameters, file_bytes, numel * item_bytes if floating else file_bytes)

    def tokenizer(self) -> Tokenizer | None:
        """The checkpoint's tokenizer, or None when it ships none."""
        return read_tokenizer(self.path, self.gguf)

    def chat_template(self) -> ChatTemplate:
        """The checkpoint's chat template (tokenizer_config.json / chat_template.jinja, or
        GGUF metadata); a LocalserveError says when there is none or it is broken."""
        if self.gguf is not None:
            return chat_template_from_gguf(self.gguf)
        return ChatTemplate.from_dir(self.path)

    def chat_template_or_none(self) -> ChatTemplate | None:
        """The chat template, or None when there is none (or it cannot be used): then
        prompts are completed as plain text."""
        try:
            return self.chat_template()
        except LocalserveError:
            return None


def read_tokenizer(path: Path, gguf: GGUFFile | None = None) -> Tokenizer | None:
    """The tokenizer of an HF folder (tokenizer.json) or of a GGUF file (its vocabulary,
    from ``gguf`` when already open), or None when it ships none; reads nothing else, so
    it works for architectures localserve cannot run."""
    if gguf is None and path.is_file():
        with read_gguf(path) as opened:
            return read_tokenizer(path, opened)
    if gguf is not None:
        if "tokenizer.ggml.model" not in gguf.metadata:
            return None
        return tokenizer_from_gguf_metadata(gguf.metadata)
    return Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint's description (not its weights yet): an HF folder or a .gguf file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise LocalserveError(f"{path}: no such file or folder")
    if path.is_file():
        gguf = read_gguf(path)
        return Checkpoint(path=path, spec=spec_from_gguf(gguf), files=[], gguf=gguf)
    config = hf.read_config(path)
    spec = hf.spec_from_config(config)
    _merge_generation_eos(path, spec)
    return Checkpoint(path=path, spec=spec, files=hf.shard_files(path), quant=quant_config_from(config))


def _merge_generation_eos(path: Path, spec: ModelSpec) -> None:
    # generation_config.json may list more end tokens than config.json (Llama 3's
    # <|eot_id|>); HF generate stops on all of them.
    gen_path = path / "generation_config.json"
    if not gen_path.is_file():
        return
    try:
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return
    for token in [eos] if isinstance(eos, int) else (eos or []):
        if isinstance(token, int) and token not in spec.eos_token_ids:
            spec.eos_token_ids.append(token)


__all__ = ["Checkpoint", "ModelSpec", "RopeSpec", "TensorSize", "open_checkpoint"]
