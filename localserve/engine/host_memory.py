"""How much host memory there is to use: read without torch, so the daemon's front (the
model manager's room checks) asks it as cheaply as ``fit`` does."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostMemory:
    """The host memory the kernel can hand out without swapping, and where the figure
    comes from (for people)."""

    available: int
    source: str


def available_host_memory() -> HostMemory:
    """What psutil reports as available (on Linux /proc/meminfo's MemAvailable: free
    memory plus the page cache and buffers that can be reclaimed)."""
    import psutil

    return HostMemory(psutil.virtual_memory().available, "MemAvailable, by psutil")
