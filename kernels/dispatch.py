"""Which kernels run: Triton on CUDA tensors, the compiled CPU kernels on CPU tensors,
else the torch references.

The choice is an engine option (``EngineConfig.disable_triton`` and
``disable_cpu_kernels``; the environment sets their defaults, read once when the config
is made). The engine's runner makes each forward under its choice (``using``), so two
engines in one process may choose differently; outside any forward, every kernel is
allowed. Kernel entry points ask ``use_triton`` / ``use_cpu_kernels``, a context
variable's read, not the environment.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KernelChoice:
    triton: bool = True  # False: the torch references on CUDA (debugging a kernel against its definition)
    cpu_kernels: bool = True  # False: the torch references on CPU (for comparison)


_CHOICE: contextvars.ContextVar[KernelChoice] = contextvars.ContextVar("localserve_kernels", default=KernelChoice())


@contextlib.contextmanager
def using(choice: KernelChoice) -> Iterator[None]:
    """Kernel calls in this block (on this thread) follow ``choice``."""
    token = _CHOICE.set(choice)
    try:
        yield
    finally:
        _CHOICE.reset(token)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(tensor: torch.Tensor) -> bool:
    """Triton on CUDA tensors (unless the choice keeps the references), else not."""
    return tensor.is_cuda and _CHOICE.get().triton and triton_available()


def use_cpu_kernels(tensor: torch.Tensor) -> bool:
    """The compiled CPU kernels on CPU tensors (unless the choice keeps the references)."""
    return tensor.device.type == "cpu" and _CHOICE.get().cpu_kernels
