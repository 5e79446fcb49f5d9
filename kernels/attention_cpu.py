"""CPU paged attention: decode tokens through the C++ kernel
(``csrc/paged_attention_cpu.cpp``), which reads each sequence's blocks in place instead of
gathering them into a padded copy; prefill chunks and 8-bit caches through the reference."""

from __future__ import annotations

import torch

from . import cpu_extension
from .attention import AttentionMetadata
from .attention_ref import decode_attention, decode_rows, prefill_attention, write_kv

__all__ = ["paged_attention", "write_kv"]


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    out = torch.empty_like(query)
    decodes = prefill_attention(query, k_cache, v_cache, meta, scale, k_scale, v_scale, out)
    if not decodes:
        return out
    rows = decode_rows(meta, decodes, query.device)
    if k_scale is None and query.dtype == k_cache.dtype == torch.float32:
        index = torch.tensor(decodes)
        out[rows] = cpu_extension.extension().paged_decode_attention(  # type: ignore[union-attr]
            query[rows].contiguous(), k_cache, v_cache, meta.block_tables[index].contiguous(),
            meta.seq_lens[index].contiguous(), scale)
    else:
        out[rows] = decode_attention(query[rows], k_cache, v_cache, meta, decodes, scale, k_scale, v_scale)
    return out
