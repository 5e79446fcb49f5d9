"""What a benchmark figure was measured on: the CPU's model, its vector flags, and the
memory bandwidth this machine gives (measured, STREAM-like), printed beside every figure.

    python benchmarks/host_facts.py          # print them for 1 and 2 threads
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

# The flags that decide which kernels run (and how fast llama.cpp's run).
VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
                "amx_int8", "amx_bf16")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.partition(":")[2].split())
                return [flag for flag in VECTOR_FLAGS if flag in have]
    except OSError:
        pass
    return []


def cpu_summary() -> str:
    import os

    family = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        fields = {key.strip(): value.strip() for key, _, value in
                  (line.partition(":") for line in text.splitlines()[:30])}
        family = f", family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
    except (OSError, ValueError):
        pass
    return f"CPU: {cpu_model()}{family}, {os.cpu_count()} cores; flags: {' '.join(cpu_flags()) or 'none of note'}"


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
