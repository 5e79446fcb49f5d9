"""Paged attention over a block-structured KV cache (paged_kv.py), for batches that
mix prefill chunks and decode tokens: the dispatchers. The torch reference
(attention_ref.py) is the definition; Triton runs it on CUDA, C++ on the CPU.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import attention_cpu, attention_ref, cpu_library
from .dispatch import use_cpu_kernels, use_triton
from .paged_kv import AttentionMetadata, KVCache


def write_kv(key: torch.Tensor, value: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values ``[num_tokens, num_kv_heads, head_dim]`` in the cache."""
    kernels = _kernels(key)
    kernels.write_kv(key, value, cache.key, cache.value, slot_mapping, cache.key_scale, cache.value_scale)


def paged_attention(query: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """Causal attention of ``query [num_tokens, num_heads, head_dim]`` over the paged
    cache; grouped-query attention when ``num_heads`` is a multiple of the cache's
    ``num_kv_heads``; with a sliding ``window``, a token at position p sees only the keys
    at positions above ``p - window``. Returns ``[num_tokens, num_heads, head_dim]``."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must hold at least one token, not {window}")
    kernels = _kernels(query)
    return kernels.paged_attention(query, cache.key, cache.value, meta, scale, cache.key_scale, cache.value_scale,
                                   window)


def _kernels(tensor: torch.Tensor) -> ModuleType:
    if use_triton(tensor):
        from . import attention_triton

        return attention_triton
    if use_cpu_kernels(tensor) and cpu_library.available():
        return attention_cpu
    return attention_ref
