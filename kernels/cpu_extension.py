"""localserve's C++ CPU kernels (``csrc/``), built on first use.

torch's JIT extension builder compiles them for this machine's own instruction set
(needs a C++ compiler and ninja). When they cannot be built, ``available()`` is False
and every caller keeps its torch reference.

The build lives in a folder named after a hash of the sources and flags, and compiles
copies of the sources placed there. So every checkout or install with the same sources
(a source tree, a wheel, the .deb) shares one build, instead of each rebuilding the
others' because its source paths differ, and changed sources get a folder of their own.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_SOURCES = ("quant_gemv_cpu.cpp", "paged_attention_cpu.cpp", "bindings.cpp")
# -march=native: the AVX2/FMA paths where the machine has them.
_CFLAGS = ("-O3", "-march=native", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
# torch's builder serialises builds with a lock file that a killed build leaves behind,
# after which every later build would wait for ever. A build takes a minute or two, so a
# lock this old is stale.
_STALE_LOCK_S = 15 * 60


@functools.cache
def extension() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load

        build = _build_directory()
        # Lists of their own: torch's builder appends to the flag lists it is given.
        return load(name=build.name, sources=[str(build / name) for name in _SOURCES], extra_cflags=list(_CFLAGS),
                    extra_ldflags=list(_LDFLAGS), build_directory=str(build), verbose=False)
    except Exception as exc:  # no compiler, no ninja, a build error: keep the references
        log.warning("CPU kernels unavailable (%s); using the torch references", exc)
        return None


def available() -> bool:
    return extension() is not None


def _build_directory() -> Path:
    """The build folder for these sources and flags, holding copies of the sources."""
    import torch

    csrc = Path(__file__).parent / "csrc"
    digest = hashlib.sha256()
    for name in _SOURCES:
        digest.update(name.encode() + b"\0" + (csrc / name).read_bytes())
    digest.update(" ".join([*_CFLAGS, *_LDFLAGS, torch.__version__]).encode())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    build = root / f"localserve_cpu_kernels_{digest.hexdigest()[:16]}"
    build.mkdir(parents=True, exist_ok=True)
    for name in _SOURCES:
        if not (build / name).exists():  # copied whole, then renamed: a reader never sees half a file
            partial = build / f"{name}.{os.getpid()}.partial"
            shutil.copyfile(csrc / name, partial)
            os.replace(partial, build / name)
    _remove_stale_lock(build / "lock")
    return build


def _remove_stale_lock(lock: Path) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > _STALE_LOCK_S:
        log.warning("removing %s, left %.0f minutes ago by a build that did not finish", lock, age / 60)
        lock.unlink(missing_ok=True)
