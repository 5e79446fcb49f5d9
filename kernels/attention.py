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
                    window: int | None = None, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of ``query [num_tokens, num_heads, head_dim]`` over the paged
    cache; grouped-query attention when ``num_heads`` is a multiple of the cache's
    ``num_kv_heads``. Returns ``[num_tokens, num_heads, head_dim]``. The variants:

    - ``scale``: multiplies q.k (1/sqrt(head_dim) for most models, not all);
    - ``window``: a token at position p sees only the keys at positions above ``p - window``;
    - ``softcap`` > 0: each scaled score s becomes ``softcap * tanh(s / softcap)`` (Gemma 2);
    - ``sinks``: one fp32 logit per query head that joins each row's softmax without a
      value, so a row may give little weight to every key (GPT-OSS);
    - ``meta.bidirectional``: ranges of positions whose tokens see each other's keys too
      (the window still applies)."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must hold at least one token, not {window}")
    if softcap < 0:
        raise ValueError(f"a soft cap must be positive (or 0 for none), not {softcap}")
    if sinks is not None and (sinks.shape != (query.shape[1],) or sinks.dtype != torch.float32):
        raise ValueError(f"sinks must be float32 [{query.shape[1]}], not {sinks.dtype} {list(sinks.shape)}")
    # Ranges that see ahead (images' tokens, in a few prefill steps) take the reference:
    # the C++ and Triton kernels are causal only.
    kernels = attention_ref if meta.bidirectional else _kernels(query)
    return kernels.paged_attention(query, cache.key, cache.value, meta, scale, cache.key_scale, cache.value_scale,
                                   window, softcap, sinks)


def _kernels(tensor: torch.Tensor) -> ModuleType:
    if use_triton(tensor):
        from . import attention_triton

        return attention_triton
    if use_cpu_kernels(tensor) and cpu_library.available():
        return attention_cpu
    return attention_ref
