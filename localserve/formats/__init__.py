"""Checkpoint readers: every on-disk format becomes a ModelSpec plus named weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import LocalserveError
from ..kernels.quant_linear import QuantWeight
from . import hf
from .hf_quant import QuantConfig, convert_quantized, quant_config_from
from .spec import ModelSpec, RopeSpec

NamedWeight = tuple[str, torch.Tensor | QuantWeight]


@dataclass(slots=True)
class Checkpoint:
    """A checkpoint's description; weights are read when ``weights()`` is iterated."""

    path: Path
    spec: ModelSpec
    files: list[Path]  # HF safetensors shards (empty for GGUF)
    quant: QuantConfig | None = None  # GPTQ/AWQ layers come out as QuantWeights
    gguf: object | None = None  # the parsed GGUFFile for .gguf checkpoints

    def weights(self) -> Iterator[NamedWeight]:
        if self.gguf is not None:
            from .gguf import iter_gguf_weights

            return iter_gguf_weights(self.gguf, self.spec)  # type: ignore[arg-type]
        tensors = hf.iter_tensors(self.files)
        return convert_quantized(tensors, self.quant) if self.quant else tensors

    def tokenizer(self):  # type: ignore[no-untyped-def]
        """The checkpoint's tokenizer, or None when it ships none."""
        from ..tokenizer import Tokenizer

        if self.gguf is not None:
            from ..gguf_tokenizer import tokenizer_from_gguf_metadata

            if "tokenizer.ggml.model" not in self.gguf.metadata:  # type: ignore[attr-defined]
                return None
            return tokenizer_from_gguf_metadata(self.gguf.metadata)  # type: ignore[attr-defined]
        return Tokenizer.from_dir(self.path) if (self.path / "tokenizer.json").is_file() else None

    def chat_template(self):  # type: ignore[no-untyped-def]
        """The checkpoint's chat template (tokenizer_config.json or GGUF metadata), or None."""
        from ..chat_template import ChatTemplate

        if self.gguf is not None:
            metadata = self.gguf.metadata  # type: ignore[attr-defined]
            template = metadata.get("tokenizer.chat_template")
            if not isinstance(template, str):
                return None
            tokens = metadata.get("tokenizer.ggml.tokens") or []

            def token(key: str) -> str | None:
                index = metadata.get(key)
                return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

            return ChatTemplate(template, bos_token=token("tokenizer.ggml.bos_token_id"),
                                eos_token=token("tokenizer.ggml.eos_token_id"))
        config_path = self.path / "tokenizer_config.json"
        if not config_path.is_file():
            return None
        try:
            return ChatTemplate.from_dir(self.path)
        except LocalserveError:
            return None


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint's description (not its weights yet): an HF folder or a .gguf file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise LocalserveError(f"{path}: no such file or folder")
    if path.is_file():
        from .gguf import spec_from_gguf
        from .gguf_file import read_gguf

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


__all__ = ["Checkpoint", "ModelSpec", "RopeSpec", "open_checkpoint"]
