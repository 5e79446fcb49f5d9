"""Plain-torch paged attention: the definition of correct, and the CPU path."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .attention import AttentionMetadata


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` cached tokens of one sequence: ``[seq_len, kv_heads, dim]``."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.flatten(0, 1)[:seq_len]


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(query)
    start = 0
    for b, (query_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        end = start + query_len
        k = gather_sequence(k_cache, meta.block_tables[b], seq_len).to(query.dtype)
        v = gather_sequence(v_cache, meta.block_tables[b], seq_len).to(query.dtype)
        out[start:end] = _causal_attention(query[start:end], k, v, scale)
        start = end
    return out


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q ``[q_len, heads, dim]`` are the last q_len of the seq_len positions in k/v."""
    q_len, seq_len = q.shape[0], k.shape[0]
    mask = None
    if q_len > 1:
        # Query i is position seq_len - q_len + i and sees keys 0..that position.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)
