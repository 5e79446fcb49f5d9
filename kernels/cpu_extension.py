"""localserve's C++ CPU kernels (``csrc/``), built on first use.

torch's JIT extension builder compiles them for this machine's own instruction set
(needs a C++ compiler and ninja) and caches the result. When they cannot be built,
``available()`` is False and every caller keeps its torch reference.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_SOURCES = ("quant_gemv_cpu.cpp", "paged_attention_cpu.cpp", "bindings.cpp")


@functools.cache
def extension() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="localserve_cpu_kernels",
            sources=[str(Path(__file__).parent / "csrc" / name) for name in _SOURCES],
            # -march=native: the AVX2/FMA paths where the machine has them.
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a build error: keep the references
        log.warning("CPU kernels unavailable (%s); using the torch references", exc)
        return None


def available() -> bool:
    return extension() is not None
