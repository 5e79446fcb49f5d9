"""What a GGUF block type is in QuantWeight's terms, and what its decoder gives: shared by
the linear and K-quant types (gguf_quants.py) and the IQ and TQ types (gguf_iquants.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Decoded:
    """One chunk of blocks in QuantWeight terms, before packing: ``codes`` uint8
    ``[n_blocks, block_elements]`` (unpacked), ``scales`` ``[n_blocks, groups_per_block]``
    and, for the mins form, ``mins`` of the same shape. Two-level types give integer
    sub-scales (and sub-mins) plus their fp16 ``super_scales`` (``super_mins``) ``[n_blocks, 1]``."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    super_scales: torch.Tensor | None = None
    super_mins: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class BlockType:
    block_elements: int
    block_bytes: int
    bits: int
    group_size: int
    zero: int | None  # constant zero point; None means the mins form (or the codebook's)
    scale_dtype: torch.dtype  # an integer type means two-level scales (K-quants, IQ4_XS)
    decode: Callable[[torch.Tensor], Decoded]
    codebook: tuple[float, ...] | None = None  # each code's value (MXFP4, the IQ types)

    @property
    def two_level(self) -> bool:
        return not self.scale_dtype.is_floating_point


def fp16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian fp16 at ``offset`` of every block of ``blocks`` (uint8
    ``[n_blocks, block_bytes]``), as fp16 ``[n_blocks, 1]``."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16)
