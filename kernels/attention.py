"""Paged attention over a block-structured KV cache, for batches that mix prefill
chunks and decode tokens.

Cache layout (one pair per layer): ``k_cache``/``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``t`` of a sequence lives
in block ``block_table[t // block_size]`` at offset ``t % block_size``; its *slot* is
``block * block_size + offset``.

A batch is flat: the new tokens of all sequences are concatenated, sequence ``b``
owning rows ``query_start_loc[b]:query_start_loc[b+1]``. Those rows are the last
``query_len`` tokens of a sequence whose cache holds ``seq_len`` tokens once this
step's keys are written, so new token ``i`` sits at position
``seq_len - query_len + i`` and attends causally to cache positions ``<= `` its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import attention_ref
from .dispatch import use_triton


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs to know about one batch, passed explicitly."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [batch + 1] int32: row offsets of each sequence
    seq_lens: torch.Tensor  # [batch] int32: cached tokens after this step's write
    block_tables: torch.Tensor  # [batch, max_blocks] int32, padded (padding never read)
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU code can loop without device syncs.
    query_lens_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's keys/values ``[num_tokens, num_kv_heads, head_dim]`` in the cache."""
    if use_triton(key):
        from . import attention_triton

        attention_triton.write_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        attention_ref.write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of ``query [num_tokens, num_heads, head_dim]`` over the paged
    cache; grouped-query attention when ``num_heads`` is a multiple of the cache's
    ``num_kv_heads``. Returns ``[num_tokens, num_heads, head_dim]``."""
    if use_triton(query):
        from . import attention_triton

        return attention_triton.paged_attention(query, k_cache, v_cache, meta, scale)
    return attention_ref.paged_attention(query, k_cache, v_cache, meta, scale)
