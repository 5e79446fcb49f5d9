"""The paged KV cache: device tensors in fixed-size blocks, and the bookkeeping of
which request owns which blocks."""

from __future__ import annotations

from collections import deque

import torch

from ..formats.spec import ModelSpec
from .request import Request


class BlockPool:
    """Hands out block ids with reference counts; a block is free at count zero.

    Counts above one arrive with prefix caching, when requests share prefix blocks.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for block in blocks:
            assert self._ref_counts[block] > 0, "sharing a free block"
            self._ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            assert self._ref_counts[block] > 0, "freeing a free block"
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)


class BlockManager:
    """Grows each request's block table on demand and frees it the moment it ends."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def try_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more cached tokens; False if the pool is short."""
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free:
            return False
        request.block_table.extend(self.pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        self.pool.free(request.block_table)
        request.block_table = []


def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * element


def allocate_kv_tensors(
    spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, each ``[num_blocks, block_size, kv_heads, head_dim]``."""
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(spec.num_layers)
    ]
