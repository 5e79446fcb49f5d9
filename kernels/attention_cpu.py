"""CPU paged attention through the C++ kernel (``csrc/paged_attention.cpp``): every row,
prefill or decode, reads its sequence's blocks in place, and a row at position p is
computed exactly as a decode at length p + 1 (the same bits however the prompt was
chunked and whatever else is in the batch). The cache may be fp32, fp16 or bf16 (widened
as it is read); 8-bit caches and non-fp32 queries take the reference."""

from __future__ import annotations

import torch

from . import attention_ref, cpu_library
from .paged_kv import AttentionMetadata
from .attention_ref import write_kv

__all__ = ["KV_TYPES", "paged_attention", "write_kv"]

# The cache types the kernel reads (csrc/api.h, ``ls_kv_type``).
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, window: int | None = None, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    if k_scale is not None or query.dtype != torch.float32 or k_cache.dtype not in KV_TYPES:
        return attention_ref.paged_attention(query, k_cache, v_cache, meta, scale, k_scale, v_scale, window, softcap,
                                             sinks)
    lib = cpu_library.library()
    assert lib is not None
    query = query.contiguous()
    tokens, heads, dim = query.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    tables, query_start = meta.block_tables.contiguous(), meta.query_start_loc.contiguous()
    seq_lens = meta.seq_lens.contiguous()
    check_tables(meta, tokens, num_blocks, block_size, tables.shape[1])
    out = torch.empty_like(query)
    sinks = sinks.contiguous() if sinks is not None else None
    lib.ls_paged_attention(query.data_ptr(), tokens, heads, dim, k_cache.data_ptr(), v_cache.data_ptr(),
                           KV_TYPES[k_cache.dtype], block_size, kv_heads, tables.data_ptr(), tables.shape[1], query_start.data_ptr(), seq_lens.data_ptr(),
                           meta.num_seqs, scale, window or 0, softcap, sinks.data_ptr() if sinks is not None else None,
                           out.data_ptr())
    return out


class _Checked:
    """The last metadata checked: every layer of a step shares one, checked once."""

    meta: AttentionMetadata | None = None


def check_tables(meta: AttentionMetadata, tokens: int, num_blocks: int, block_size: int, max_blocks: int) -> None:
    """The kernel trusts its tables: lengths and the block ids it will read are checked here."""
    if meta is _Checked.meta:
        return
    _require(meta.block_tables.dtype == meta.seq_lens.dtype == meta.query_start_loc.dtype == torch.int32,
             "block tables, lengths and offsets must be int32")
    _require(sum(meta.query_lens_host) == tokens and len(meta.seq_lens_host) == meta.block_tables.shape[0],
             "rows do not match the batch")
    used = [-(-s // block_size) for s in meta.seq_lens_host]
    _require(all(1 <= q <= s for q, s in zip(meta.query_lens_host, meta.seq_lens_host))
             and max(used, default=0) <= max_blocks, "bad sequence length")
    # On the host: a decode step's few torch ops here cost more than its attention.
    ids = [row[:n] for row, n in zip(meta.block_tables.tolist(), used) if n]
    _require(all(0 <= min(row) and max(row) < num_blocks for row in ids), "bad block id")
    _Checked.meta = meta


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)
