"""What a benchmark figure was measured on: the CPU's model, its vector flags, and the
memory bandwidth this machine gives (measured, STREAM-like), printed beside every figure.

    python benchmarks/host_facts.py          # print them for 1 and 2 threads
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def cpu_summary() -> str:
    """The CPU's model (and family/model numbers: "AMD EPYC" alone does not tell Zen 3 from
    Zen 4), cores and the vector flags the kernels use, as ``localserve doctor`` names them."""
    from localserve.doctor.host import ISA_FLAGS
    from localserve.kernels import cpu_library
    from localserve.server.host import device_name

    family = ""
    try:
        fields = {key.strip(): value.strip() for key, _, value in
                  (line.partition(":") for line in Path("/proc/cpuinfo").read_text().splitlines()[:30])}
        family = f", family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
    except OSError:
        pass
    flags = " ".join(flag for flag in ISA_FLAGS if flag in cpu_library.cpu_flags()) or "none the kernels use"
    return f"CPU: {device_name('cpu')}{family}, {os.cpu_count()} cores; flags: {flags}"


def measure_bandwidth(threads: int, megabytes: int = 512, repeats: int = 7) -> float:
    """Bytes per second read from memory by ``threads`` threads: the best of ``repeats``
    sums over a ``megabytes`` array (far beyond any cache), the way a decode step reads
    its weights. A copy's figure (read + write) is ``measure_copy``."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(megabytes * (1 << 20) // 4)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - start)
        return data.numel() * 4 / best
    finally:
        torch.set_num_threads(previous)


def measure_copy(threads: int, megabytes: int = 512, repeats: int = 7) -> float:
    """STREAM's Copy: bytes read plus bytes written per second, best of ``repeats``."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        source = torch.ones(megabytes * (1 << 20) // 4)
        target = torch.empty_like(source)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            target.copy_(source)
            best = min(best, time.perf_counter() - start)
        return 2 * source.numel() * 4 / best
    finally:
        torch.set_num_threads(previous)


if __name__ == "__main__":
    print(cpu_summary())
    for count in (1, 2):
        print(f"{count} thread(s): read {measure_bandwidth(count) / 1e9:.1f} GB/s, "
              f"copy {measure_copy(count) / 1e9:.1f} GB/s")
