"""Moves KV blocks between the device pool and the CPU tier.

The manager (``kv_cache.py``) decides which blocks move; this performs the copies for
every tensor of every layer (K and V, and their scales in an 8-bit cache), all
device-to-CPU ones first, then the CPU-to-device ones. A block is copied as bytes,
whatever its dtype (CPU index_copy_ has no float8 kernel).

On CUDA the copies run on a side stream into pinned host memory, so they overlap
with whatever the host does meanwhile; the side stream first waits for the work
already queued (the blocks' last writes), and the compute stream waits for the
copies before the next forward reads or overwrites those blocks. On a CPU-only host
both pools are RAM and a copy is one gather and one scatter per tensor.
"""

from __future__ import annotations

import torch

from ..kernels import KVCache
from .kv_cache import BlockCopies


class KVTransfer:
    def __init__(self, device_caches: list[KVCache], cpu_caches: list[KVCache]) -> None:
        # (device, cpu) tensor pairs, as bytes.
        self.pairs = [
            (device_tensor.view(torch.uint8), cpu_tensor.view(torch.uint8))
            for device_cache, cpu_cache in zip(device_caches, cpu_caches)
            for device_tensor, cpu_tensor in zip(device_cache.tensors(), cpu_cache.tensors())
        ]
        device = device_caches[0].key.device if device_caches else torch.device("cpu")
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self, copies: BlockCopies) -> None:
        if not copies:
            return
        if self.stream is None:
            self._copy(copies.to_cpu, to_cpu=True)
            self._copy(copies.to_device, to_cpu=False)
            return
        compute = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy(copies.to_cpu, to_cpu=True)
            self._copy(copies.to_device, to_cpu=False)
        compute.wait_stream(self.stream)

    def _copy(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        if not pairs:
            return
        sources, targets = zip(*pairs)
        if self.stream is None:
            src = torch.tensor(sources, dtype=torch.int64)
            dst = torch.tensor(targets, dtype=torch.int64)
            for device_tensor, cpu_tensor in self.pairs:
                source, target = (device_tensor, cpu_tensor) if to_cpu else (cpu_tensor, device_tensor)
                target.index_copy_(0, dst, source.index_select(0, src))
            return
        # CUDA: one asynchronous copy per block (each block is contiguous in its tensor).
        for device_tensor, cpu_tensor in self.pairs:
            source, target = (device_tensor, cpu_tensor) if to_cpu else (cpu_tensor, device_tensor)
            for s, t in zip(sources, targets):
                target[t].copy_(source[s], non_blocking=True)
