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


@dataclass(slots=True)
class Checkpoint:
    path: Path
    spec: ModelSpec
    files: list[Path]
    quant: QuantConfig | None = None  # GPTQ/AWQ layers come out as QuantWeights

    def weights(self) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
        tensors = hf.iter_tensors(self.files)
        return convert_quantized(tensors, self.quant) if self.quant else tensors


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint's description (not its weights yet)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise LocalserveError(f"{path}: no such file or folder")
    if not path.is_dir():
        raise LocalserveError(f"{path}: expected an HF checkpoint folder (config.json + *.safetensors)")
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
