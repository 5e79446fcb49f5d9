"""Compute kernels: each op has a plain-torch reference (the definition of correct),
a Triton kernel for CUDA and C++ kernels for the CPU.

The data types the kernels share live apart from the dispatchers that pick a kernel:
``paged_kv.py`` (the KV cache and a batch's attention metadata), ``quant_weight.py``
(``QuantWeight``), ``experts.py`` (a MoE layer's stacked experts). The dispatchers
(``attention.py``, ``quant_linear.py``, ``moe.py``) choose by the tensors' device and
the engine's choice (``dispatch.py``). This package imports nothing else of localserve.
"""

from .attention import paged_attention, write_kv
from .paged_kv import AttentionMetadata, KVCache, is_8bit

__all__ = ["AttentionMetadata", "KVCache", "is_8bit", "paged_attention", "write_kv"]
