"""Moves KV blocks between the device pool and the CPU tier.

The manager (``kv_cache.py``) decides which blocks move; this performs the copies for
every layer's K and V, all device-to-CPU ones first, then the CPU-to-device ones.

On CUDA the copies run on a side stream into pinned host memory, so they overlap
with whatever the host does meanwhile; the side stream first waits for the work
already queued (the blocks' last writes), and the compute stream waits for the
copies before the next forward reads or overwrites those blocks. On a CPU-only host
both pools are RAM and a copy is one gather and one scatter per tensor.
"""

from __future__ import annotations

import torch

from .kv_cache import BlockCopies

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class KVTransfer:
    def __init__(self, device_caches: KVCaches, cpu_caches: KVCaches) -> None:
        self.device_caches = device_caches
        self.cpu_caches = cpu_caches
        device = device_caches[0][0].device if device_caches else torch.device("cpu")
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
            for device_pair, cpu_pair in zip(self.device_caches, self.cpu_caches):
                for device_cache, cpu_cache in zip(device_pair, cpu_pair):
                    source, target = (device_cache, cpu_cache) if to_cpu else (cpu_cache, device_cache)
                    target.index_copy_(0, dst, source.index_select(0, src))
            return
        # CUDA: one asynchronous copy per block (each block is contiguous in its layer).
        for device_pair, cpu_pair in zip(self.device_caches, self.cpu_caches):
            for device_cache, cpu_cache in zip(device_pair, cpu_pair):
                source, target = (device_cache, cpu_cache) if to_cpu else (cpu_cache, device_cache)
                for s, t in zip(sources, targets):
                    target[t].copy_(source[s], non_blocking=True)
