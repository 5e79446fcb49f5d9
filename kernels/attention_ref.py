"""Plain-torch paged attention: the definition of correct, and the CPU path.

Decode rows (one query token) of the whole batch go through one batched SDPA call
over their gathered blocks; prefill rows go one sequence at a time. Inputs to SDPA
are always 4-D: on CPU, 3-D inputs and many small calls fall onto slow paths.
"""

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


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The first ``num_blocks`` blocks of each table, as ``[batch, kv_heads, tokens, dim]``."""
    batch = block_tables.shape[0]
    # index_select on flat block ids copies far faster on CPU than advanced indexing.
    ids = block_tables[:, :num_blocks].reshape(-1).long()
    blocks = cache.index_select(0, ids).view(batch, -1, *cache.shape[2:])
    return blocks.transpose(1, 2)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(query)
    block_size = k_cache.shape[1]
    gqa = query.shape[1] != k_cache.shape[2]
    decodes: list[int] = []
    row = 0
    for b, (query_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        if query_len == 1:
            decodes.append(b)
        else:
            num_blocks = -(-seq_len // block_size)
            k = gather_blocks(k_cache, meta.block_tables[b : b + 1], num_blocks)[:, :, :seq_len]
            v = gather_blocks(v_cache, meta.block_tables[b : b + 1], num_blocks)[:, :, :seq_len]
            q = query[row : row + query_len].transpose(0, 1).unsqueeze(0)
            # Query i is position seq_len - query_len + i and sees keys 0..that position.
            q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device) <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=gqa)
            out[row : row + query_len] = o[0].transpose(0, 1)
        row += query_len

    if decodes:
        index = torch.tensor(decodes, device=query.device)
        rows = meta.query_start_loc[index].long()
        seq_lens = meta.seq_lens[index]
        num_blocks = -(-max(meta.seq_lens_host[b] for b in decodes) // block_size)
        tables = meta.block_tables[index]
        k = gather_blocks(k_cache, tables, num_blocks).to(query.dtype)
        v = gather_blocks(v_cache, tables, num_blocks).to(query.dtype)
        mask = torch.arange(k.shape[2], device=query.device) < seq_lens[:, None].long()
        q = query[rows].unsqueeze(2)  # [batch, heads, 1, dim]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=gqa)
        out[rows] = o.squeeze(2)
    return out
