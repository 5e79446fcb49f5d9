"""The memory an image encoder's step takes, estimated from the tower's shapes (for
``localserve fit`` and a GPU's KV budget: the engine profiles a text step, not an encode),
and the rule that bounds it: the images a step's prefill chunks reach are encoded in
batches of at most ``BATCH_PATCHES`` patches (an image with more, alone)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from .config import ImageConfig

Item = TypeVar("Item")

# Four Gemma 3 images (4,096 patches each), or one Qwen-VL image of ~3.2 million pixels:
# enough to keep a step's matmuls large, bounded whatever a step reaches.
BATCH_PATCHES = 16_384


def encoder_activation_bytes(config: ImageConfig, dtype: torch.dtype, batch_patches: int = BATCH_PATCHES) -> int:
    """Peak bytes of one encoder batch's activations: its patches (the budget, or the
    largest image the processor makes when that has more) times the values each keeps
    live at a layer's peak (the config's ``floats_per_patch``). Attention adds no
    patches x patches scores: SDPA's flash and memory-efficient kernels keep none."""
    patches = max(batch_patches, config.max_patches)
    return patches * config.floats_per_patch * torch.empty((), dtype=dtype).element_size()


def batches(items: Sequence[Item], patches_for: Callable[[Item], int],
            batch_patches: int = BATCH_PATCHES) -> list[list[Item]]:
    """``items`` in order, in runs of at most ``batch_patches`` patches (an item with
    more makes a run of its own)."""
    runs: list[list[Item]] = []
    patches = 0
    for item in items:
        size = patches_for(item)
        if not runs or patches + size > batch_patches:
            runs.append([])
            patches = 0
        runs[-1].append(item)
        patches += size
    return runs
