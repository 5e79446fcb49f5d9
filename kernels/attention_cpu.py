"""CPU paged attention: decode tokens through the C++ kernel
(``csrc/paged_attention_cpu.cpp``), which reads each sequence's blocks in place instead of
gathering them into a padded copy; prefill chunks and 8-bit caches through the reference."""

from __future__ import annotations

from functools import partial

import torch

from . import attention_ref, cpu_extension
from .attention import AttentionMetadata
from .attention_ref import write_kv

__all__ = ["paged_attention", "write_kv"]


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     decodes: list[int], scale: float, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    if k_scale is not None or not query.dtype == k_cache.dtype == torch.float32:
        return attention_ref.decode_attention(query, k_cache, v_cache, meta, decodes, scale, k_scale, v_scale)
    tables, seq_lens = meta.block_tables, meta.seq_lens
    if len(decodes) < meta.num_seqs:  # some sequences are prefilling: just the decodes' rows
        index = torch.tensor(decodes)
        tables, seq_lens = tables[index].contiguous(), seq_lens[index].contiguous()
    return cpu_extension.extension().paged_decode_attention(  # type: ignore[union-attr]
        query.contiguous(), k_cache, v_cache, tables, seq_lens, scale)


paged_attention = partial(attention_ref.paged_attention, decode=decode_attention)
