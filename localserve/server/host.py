"""The host the daemon runs on, for the dashboard's header: CPU and memory (psutil)
and, when nvidia-ml-py is installed and a GPU is there, each GPU's utilisation and
memory. Nothing here imports torch: the device's name is found once, at start-up."""

from __future__ import annotations

import platform
from functools import cache
from typing import Any

import psutil


@cache
def nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # not installed, no driver, no GPU: the header says "no GPU"
        return None


def gpu_stats() -> list[dict[str, Any]]:
    library = nvml()
    if library is None:
        return []
    gpus = []
    for index in range(library.nvmlDeviceGetCount()):
        handle = library.nvmlDeviceGetHandleByIndex(index)
        memory = library.nvmlDeviceGetMemoryInfo(handle)
        name = library.nvmlDeviceGetName(handle)
        gpus.append({"index": index, "name": name.decode() if isinstance(name, bytes) else name,
                     "utilization_percent": library.nvmlDeviceGetUtilizationRates(handle).gpu,
                     "memory_used_bytes": memory.used, "memory_total_bytes": memory.total})
    return gpus


def device_name(device: str) -> str:
    """The GPU's name for a CUDA device, else the CPU's model (Linux) or architecture."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "CPU"


def host_stats(device: str, name: str) -> dict[str, Any]:
    memory = psutil.virtual_memory()
    return {"device": device, "device_name": name, "cpu_percent": psutil.cpu_percent(interval=None),
            "memory_total_bytes": memory.total, "memory_used_bytes": memory.total - memory.available,
            "gpus": gpu_stats()}
