"""Chooses between a Triton kernel and its torch reference."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(tensor: torch.Tensor) -> bool:
    """Triton on CUDA tensors, the torch reference elsewhere.

    LOCALSERVE_DISABLE_TRITON=1 forces the reference everywhere (for debugging a
    kernel against its definition on a real GPU).
    """
    if os.environ.get("LOCALSERVE_DISABLE_TRITON") == "1":
        return False
    return tensor.is_cuda and triton_available()


def use_cpu_kernels(tensor: torch.Tensor) -> bool:
    """The compiled CPU kernels on CPU tensors; LOCALSERVE_DISABLE_CPU_KERNELS=1 keeps the
    torch reference (for comparison)."""
    return tensor.device.type == "cpu" and os.environ.get("LOCALSERVE_DISABLE_CPU_KERNELS") != "1"

