"""The torch paged-attention reference against naive dense attention written out
by hand (explicit scores, causal mask, softmax), on mixed batches."""

from __future__ import annotations

import math

import pytest
import torch

from localserve.kernels import AttentionMetadata, paged_attention, write_kv


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [q_len, H, D] are the last q_len positions of k/v [seq_len, KV, D]."""
    q_len, heads = q.shape[0], q.shape[1]
    seq_len, kv_heads = k.shape[0], k.shape[1]
    out = torch.empty_like(q)
    for h in range(heads):
        kh, vh = k[:, h // (heads // kv_heads)], v[:, h // (heads // kv_heads)]
        for i in range(q_len):
            visible = seq_len - q_len + i + 1
            scores = (kh[:visible] @ q[i, h]) * scale
            out[i, h] = torch.softmax(scores, dim=0) @ vh[:visible]
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_mixed_batch_equals_naive(heads: int, kv_heads: int) -> None:
    torch.manual_seed(0)
    dim, block_size, num_blocks = 16, 4, 64
    # (cached context, new tokens): fresh prefill, chunk after context, decodes.
    shapes = [(0, 9), (6, 5), (13, 1), (0, 1), (22, 1), (3, 7)]
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks).tolist()  # blocks out of order in the pool
    tables, full_k, full_v, queries, slots = [], [], [], [], []
    for context, new in shapes:
        total = context + new
        table = [free.pop() for _ in range(math.ceil(total / block_size))]
        tables.append(table)
        k, v = torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
        full_k.append(k)
        full_v.append(v)
        positions = range(total)
        slot = torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions])
        # Context is already cached; this step writes the new tokens through write_kv.
        write_kv(k[:context], v[:context], k_cache, v_cache, slot[:context])
        slots.append(slot[context:])
        queries.append(torch.randn(new, heads, dim))
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes)])
    slot_mapping = torch.cat(slots)
    write_kv(new_k, new_v, k_cache, v_cache, slot_mapping)

    width = max(map(len, tables))
    query_lens = [n for _, n in shapes]
    seq_lens = [c + n for c, n in shapes]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
    )
    scale = dim**-0.5
    out = paged_attention(torch.cat(queries), k_cache, v_cache, meta, scale)
    expected = torch.cat([naive_attention(q, k, v, scale) for q, k, v in zip(queries, full_k, full_v)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
