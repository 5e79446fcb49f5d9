"""Compute kernels: each op is a Triton kernel for CUDA plus a plain-torch reference.

The reference is the definition of correct and the CPU path; dispatchers pick the
Triton kernel when the tensors live on CUDA and Triton is importable. This package
imports nothing else of localserve.
"""

from .attention import AttentionMetadata, KVCache, is_8bit, paged_attention, write_kv

__all__ = ["AttentionMetadata", "KVCache", "is_8bit", "paged_attention", "write_kv"]
