"""The host's facts for a bug report: versions, the CPU and the kernels built for it, the GPU."""

from __future__ import annotations

import sys

import torch

from .. import __version__
from ..engine.config import EngineConfig
from ..kernels import cpu_library
from ..server.host import device_name, nvml

# CPU features the compiled kernels use, as /proc/cpuinfo names them.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile")

# Peak memory bandwidth (GB/s) of common cards, by a part of their name: the fallback when
# neither torch nor NVML reports the memory clock and bus width.
PEAK_BANDWIDTH_GBPS = {
    "H200": 4800, "H100 SXM": 3350, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039,
    "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "L40": 864, "L4": 300, "A10G": 600, "A10": 600,
    "RTX 4090": 1008, "RTX 4080": 717, "RTX 3090": 936, "RTX 3080": 760, "RTX A6000": 768, "RTX 6000 Ada": 960,
}

# Dense fp16 tensor-core peak (TFLOP/s, fp32 accumulate, no sparsity) by a part of the name,
# from the makers' data sheets: what a prefill GEMM is measured against.
PEAK_FP16_TFLOPS = {
    "H200": 989, "H100 SXM": 989, "H100 NVL": 835, "H100 PCIe": 756, "H100": 989, "A100": 312, "L40S": 362,
    "L40": 181, "L4": 121, "A10G": 70, "A10": 125, "RTX 4090": 165, "RTX 4080": 97, "RTX 3090": 71,
    "RTX 3080": 60, "RTX A6000": 155, "RTX 6000 Ada": 364,
}


def host_facts() -> dict[str, str]:
    facts = {
        "localserve": __version__,
        "python": sys.version.split()[0],
        "torch": f"{torch.__version__} ({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU build'})",
        "triton": _triton_version(),
        "cpu": f"{device_name('cpu')}; {EngineConfig().cpu_threads()} kernel threads",
        "cpu isa": " ".join(flag for flag in ISA_FLAGS if flag in cpu_library.cpu_flags()) or "none of those used",
        "cpu kernels": cpu_library.variant() or "not built (the torch references run)",
    }
    if not torch.cuda.is_available():
        facts["gpu"] = "no GPU found" + ("" if torch.version.cuda else " (this torch is a CPU build)")
        return facts
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        peak = peak_bandwidth(index)
        facts[f"gpu {index}"] = (f"{props.name}, compute {props.major}.{props.minor}, {props.multi_processor_count} SMs, "
                                 f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free, "
                                 f"peak bandwidth {f'{peak / 1e9:.0f} GB/s' if peak else 'unknown'}")
    facts["driver"] = _driver_version()
    return facts


def peak_bandwidth(index: int = 0) -> float | None:
    """The GPU's peak memory bandwidth in bytes/s: from its memory clock and bus width
    (torch's device properties, else NVML), else the table of known cards."""
    props = torch.cuda.get_device_properties(index)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if not (clock_khz and bus_bits):
        library = nvml()
        if library is not None:
            try:
                handle = library.nvmlDeviceGetHandleByIndex(index)
                clock_khz = library.nvmlDeviceGetMaxClockInfo(handle, library.NVML_CLOCK_MEM) * 1000
                bus_bits = library.nvmlDeviceGetMemoryBusWidth(handle)
            except Exception:  # an old driver without these queries
                clock_khz = bus_bits = 0
    if clock_khz and bus_bits:
        return clock_khz * 1000 * 2 * bus_bits / 8  # double data rate
    for part, gbps in PEAK_BANDWIDTH_GBPS.items():
        if part in props.name:
            return gbps * 1e9
    return None


def peak_fp16_flops(index: int = 0) -> float | None:
    """The GPU's dense fp16 tensor-core peak in flop/s, from the table of known cards."""
    name = torch.cuda.get_device_properties(index).name
    for part, tflops in PEAK_FP16_TFLOPS.items():
        if part in name:
            return tflops * 1e12
    return None


def _driver_version() -> str:
    library = nvml()
    if library is None:
        return "unknown (install nvidia-ml-py to see it)"
    version = library.nvmlSystemGetDriverVersion()
    return version.decode() if isinstance(version, bytes) else str(version)


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed (GPU kernels need it)"
    return str(triton.__version__)
