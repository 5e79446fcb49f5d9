"""A checkpoint's weights as a model on the engine's device: built from the file, or mapped
from its stored CPU layout (prepared_store.py) when there is one. The engine loads its
model here, and a draft model (speculative/draft_model.py) its own."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .. import models
from ..formats import Checkpoint
from ..formats.weights import NamedWeight
from ..kernels.dispatch import KernelChoice
from . import prepared_store
from .config import EngineConfig
from .stats import LoadProgress


def _counted(weights: Iterator[NamedWeight], progress: LoadProgress) -> Iterator[NamedWeight]:
    for weight in weights:
        yield weight
        progress.done += 1


def load_model(checkpoint: Checkpoint, config: EngineConfig, device: torch.device, dtype: torch.dtype,
               kernels: KernelChoice, context: int, progress: LoadProgress,
               cpu_moe: bool = True) -> models.LlamaForCausalLM:
    """The model built from ``checkpoint`` for positions up to ``context``, or mapped from
    its stored CPU layout; a built model's layout is stored. ``cpu_moe``: whether the
    config's ``cpu_moe`` applies (the served model's experts, not a draft model's)."""
    on_int8_kernels = device.type == "cpu" and kernels.cpu_kernels and not config.exact_cpu_matmul
    stored = prepared_store.location(config.prepared_cache, checkpoint, dtype) if on_int8_kernels else None
    if stored is not None and (model := prepared_store.load(checkpoint.spec, stored, device, dtype,
                                                            context)) is not None:
        progress.done = progress.total
        return model
    cpu_moe_layers = config.cpu_moe_layers(checkpoint.spec.num_layers) if cpu_moe else 0
    model = models.build(checkpoint.spec, _counted(checkpoint.weights(), progress), device, dtype, context,
                         cpu_moe_layers=cpu_moe_layers, exact_cpu_matmul=config.exact_cpu_matmul,
                         cpu_kernels=kernels.cpu_kernels)
    if stored is not None:
        prepared_store.store(model, stored, checkpoint)
    return model
