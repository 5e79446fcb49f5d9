"""Builds localserve's CPU kernels with the package (wheel, sdist install, editable install).

The C++ sources in kernels/csrc use no torch and no Python API: each is compiled once per
instruction set into a plain shared library (``localserve/kernels/_cpu_<variant>.so``)
that localserve.kernels.cpu_library loads through ctypes, choosing at run time the best
one this CPU can run. So one build serves AVX-512 and AVX2-only hosts alike (nothing is
built with -march=native), and the wheel does not depend on the torch version. A host
with no C++ compiler still installs: the libraries are optional, and localserve then runs
its torch reference kernels after one warning line. ``LOCALSERVE_PREBUILT_KERNELS=DIR``
packages the libraries already built in DIR instead of compiling (the test suite's wheel
build takes its editable install's: the same sources, compiled minutes earlier).

Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import copy
import os
import platform
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = Path("kernels") / "csrc"
SOURCES = sorted(str(path) for path in CSRC.glob("*.cpp"))
# GCC 12 warns of "uninitialized" pass-through operands inside its own AVX-512 intrinsics.
COMMON_FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-fvisibility=hidden", "-fno-math-errno", "-Wno-maybe-uninitialized"]

# One library per instruction set, best first (kernels/cpu_library.py keeps the same order).
X86_VARIANTS = {
    "avx512_vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma",
                    "-mf16c", "-mtune=icelake-server"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mtune=haswell"],
}


def variants() -> dict[str, list[str]]:
    if os.environ.get("LOCALSERVE_NO_CPU_KERNELS") == "1":  # a pure-Python install, on request
        return {}
    if platform.machine().lower() in ("x86_64", "amd64"):
        return X86_VARIANTS
    return {"generic": []}  # other architectures: portable C++, vectorised by the compiler


class BuildCpuKernels(build_ext):
    """Plain shared libraries (no Python ABI tag), built in parallel; one that fails to
    build is left out with a warning instead of failing the install."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def build_extensions(self) -> None:
        # The variants build side by side; within each, the sources compile in parallel too
        # (a GPU machine's 16 cores build in seconds what one core takes minutes for).
        serial = self.compiler.compile

        def compile_each(sources: list[str], *args, **kwargs) -> list[str]:  # type: ignore[no-untyped-def]
            with ThreadPoolExecutor(self.parallel) as pool:
                return [obj for objs in pool.map(lambda source: serial([source], *args, **kwargs), sources)
                        for obj in objs]

        self.compiler.compile = compile_each
        super().build_extensions()

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + ".so"

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []  # not Python modules: no PyInit_ symbol to export

    def build_extension(self, ext: Extension) -> None:
        prebuilt = os.environ.get("LOCALSERVE_PREBUILT_KERNELS")
        if prebuilt:  # libraries already built from these very sources: packaged, not compiled again
            target = Path(self.get_ext_fullpath(ext.name))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(prebuilt) / target.name, target)
            return
        # Every variant compiles the same sources: each gets its own object folder, or the
        # parallel builds would overwrite each other's objects.
        own = copy.copy(self)
        own.build_temp = os.path.join(self.build_temp, ext.name.rpartition(".")[2])
        try:
            build_ext.build_extension(own, ext)
        except Exception as exc:  # no compiler, an old one without these flags: run on the references
            print(f"warning: localserve CPU kernels ({ext.name}) not built: {exc}", file=sys.stderr)


setup(
    ext_modules=[
        Extension(f"localserve.kernels._cpu_{name}", sources=SOURCES, depends=[str(p) for p in CSRC.glob("*.h")],
                  extra_compile_args=COMMON_FLAGS + flags, extra_link_args=["-fopenmp"], language="c++",
                  optional=True)
        for name, flags in variants().items()
    ],
    cmdclass={"build_ext": BuildCpuKernels},
)
