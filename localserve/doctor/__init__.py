"""``localserve doctor``: what this machine has and whether localserve works on it.

The host's facts (versions, CPU features and the kernels built for them, each GPU's
capability and free memory), then checks: every kernel this host runs against its torch
reference (on a GPU the first call compiles each Triton kernel for the device), the
built-in demo model end to end, and on a GPU the kernels' microbenchmarks with the
performance targets as pass/fail lines (``bench.py``).
"""

from __future__ import annotations

import torch

from ..registry.builtin import DEMO_FOLDER
from .bench import gpu_benchmarks
from .checks import kernel_checks, model_check
from .host import host_facts
from .report import Report


def diagnose(benchmarks: bool = True) -> Report:
    report = Report(host_facts())
    devices = [torch.device("cuda", index) for index in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    for device in devices or [torch.device("cpu")]:
        kernel_checks(report, device)
        model_check(report, device, str(DEMO_FOLDER / "stories260K.gguf"))
        if device.type == "cuda" and benchmarks:
            gpu_benchmarks(report, device)
    if not devices:
        report.add("GPU", "skip", "no GPU found: the CPU kernels above serve (the GPU checks and benchmarks run "
                   "where torch sees a CUDA device)")
    return report
