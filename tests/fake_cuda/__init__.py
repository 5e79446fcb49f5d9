"""A CUDA card faked on a CPU-only host, to run the engine's CUDA path without a GPU.

torch's FakeTensorMode carries shapes, dtypes and devices through every op without data,
so tensors on device ``cuda:0`` exist on a CPU-only torch, kernels registered as custom
ops run their fake implementations, and an op that mixes devices fails as it would on a
GPU. Around that, ``fake_gpu`` fakes what a card answers:

- a no-op CUDA device guard (``guard.cpp``, compiled at first use): a CPU-only torch has
  none, and Python methods on a CUDA tensor (``copy_``, indexing) take one;
- ``torch.cuda``'s queries for a named card (properties, capability, ``mem_get_info``)
  and its allocator's counters, which count the bytes of the fake CUDA tensors alive
  (measured per op, so a step's peak is its real peak at op granularity), plus a CUDA
  context's worth of memory in use from the start;
- streams, which order nothing;
- a value read back to the host (``.tolist()``, ``.item()``), which is 0 (fake tensors
  have no values): the engine goes on with token 0 everywhere;
- CUDA graphs: ``torch.cuda.graph`` runs its block as a capture would, except that
  what a real capture refuses fails here too (reading a value back to the host, copying
  host memory to the device); a replay runs nothing, as a real one runs no Python.

The host is real: an op on real CPU tensors only (reading a checkpoint, stacking its
experts, staging a step's indices) computes for real; tensors become fake as they move
to the device (or into pinned memory, which only a GPU gives).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves, tree_map_only

GiB = 1 << 30
DEVICE = torch.device("cuda", 0)


@dataclass(frozen=True)
class Card:
    name: str
    total_memory: int
    capability: tuple[int, int]
    multi_processor_count: int
    context_bytes: int = 500 << 20  # what the CUDA context and cuBLAS take before any tensor


RTX_4090 = Card("NVIDIA GeForce RTX 4090", 24 * GiB, (8, 9), 128)
A100_80GB = Card("NVIDIA A100-SXM4-80GB", 80 * GiB, (8, 0), 108)


class FakeCudaMode(FakeTensorMode):
    """FakeTensorMode that counts the live bytes of CUDA tensors, answers host reads
    with 0, and records which ops ran (the custom kernels by name)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.capacity = capacity  # bytes tensors may take before an allocation fails
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage -> (weak ref, bytes)
        self.peak = 0
        self.ops: Counter[str] = Counter()
        self.cpu_ops: Counter[str] = Counter()  # ops whose tensors are all on the CPU
        self.capturing = False  # inside torch.cuda.graph(...)
        # Graph memory pools: what their captures took at most, kept for their replays.
        self.graph_pools: dict[object, int] = {}

    @property
    def avoid_device_init(self) -> bool:
        # There is no device, whatever the faked torch.cuda.is_available says: never
        # compute a constant on it for real.
        return True

    def may_turn_const(self, tensor: torch.Tensor) -> bool:
        # Nor keep a one-element tensor's value to compute with it for real later: moved
        # to the device, it would be computed on a device that does not exist.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        self.ops[func.name()] += 1
        if _host_only(args, kwargs):
            # Host work on host data (reading a checkpoint, staging indices) is real.
            self.cpu_ops[func.name()] += 1
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if self.capturing:
            _check_capturable(func, args, kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0
        # Host tensors going to the device (or meeting device tensors) become fake.
        args, kwargs = tree_map_only(torch.Tensor, self._fake, (args, kwargs))
        out = super().__torch_dispatch__(func, types, args, kwargs)
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if tensors and all(t.device.type == "cpu" for t in tensors):
            self.cpu_ops[func.name()] += 1
        for tensor in tree_leaves(out):
            if isinstance(tensor, FakeTensor) and tensor.device.type == "cuda":
                storage = tensor.untyped_storage()
                if storage._cdata not in self.live:
                    self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        allocated = self.allocated
        self.peak = max(self.peak, allocated)
        if allocated > self.capacity:
            raise torch.OutOfMemoryError(f"CUDA out of memory: {allocated / GiB:.2f} GiB allocated, "
                                         f"{self.capacity / GiB:.2f} GiB free at start")
        return out

    @property
    def allocated(self) -> int:
        """Bytes of the CUDA storages alive now, and of the graphs' memory pools."""
        return self.tensor_bytes + sum(self.graph_pools.values())

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the CUDA storages alive now."""
        self.live = {key: entry for key, entry in self.live.items() if not entry[0].expired()}
        return sum(size for _, size in self.live.values())

    def _fake(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if isinstance(tensor, FakeTensor) else self.from_tensor(tensor)


class CaptureError(RuntimeError):
    """What CUDA answers an op that cannot be captured into a graph."""


def _check_capturable(func, args: tuple, kwargs: dict) -> None:  # type: ignore[no-untyped-def, type-arg]
    if func is torch.ops.aten._local_scalar_dense.default:
        raise CaptureError(f"a value read back to the host while a CUDA graph is captured ({func.name()})")
    if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(not isinstance(t, FakeTensor) and t.device.type == "cpu" for t in tensors):
            raise CaptureError(f"host memory copied to the device while a CUDA graph is captured ({func.name()})")


class FakeCUDAGraph:
    """A graph that records nothing: captured by ``torch.cuda.graph`` under the checks,
    replayed as a no-op (counted)."""

    def __init__(self) -> None:
        self.captured = False
        self.replays = 0
        self.pool_id: tuple[int, int] = (0, id(self))  # its own, unless captured into another's

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("replay of a CUDA graph never captured")
        self.replays += 1

    def pool(self) -> tuple[int, int]:
        return self.pool_id


def _host_only(args: tuple, kwargs: dict) -> bool:  # type: ignore[type-arg]
    """Whether an op touches no fake tensor and asks for no device memory (pinned host
    memory is the device's to give)."""
    for value in tree_leaves((args, kwargs)):
        if isinstance(value, FakeTensor) or (isinstance(value, torch.device) and value.type != "cpu"):
            return False
    return not kwargs.get("pin_memory")


@dataclass
class FakeGPU:
    card: Card

    def __post_init__(self) -> None:
        self.mode = FakeCudaMode(self.card.total_memory - self.card.context_bytes)

    @property
    def in_use(self) -> int:
        return self.card.context_bytes + self.mode.allocated

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return self.card.total_memory - self.in_use, self.card.total_memory

    def properties(self, device: Any = None) -> SimpleNamespace:
        major, minor = self.card.capability
        return SimpleNamespace(name=self.card.name, total_memory=self.card.total_memory, major=major, minor=minor,
                               multi_processor_count=self.card.multi_processor_count)

    def reset_peak(self, device: Any = None) -> None:
        self.mode.peak = self.mode.allocated

    @contextlib.contextmanager
    def graph(self, cuda_graph: FakeCUDAGraph, pool: Any = None, stream: Any = None,
              capture_error_mode: str = "global") -> Iterator[None]:
        """``torch.cuda.graph``: the block runs under the checks; the memory it took at its
        peak, less the tensors it leaves alive (the graph's outputs), stays in the pool."""
        mode = self.mode
        if mode.capturing:
            raise CaptureError("a CUDA graph captured inside another's capture")
        if pool is not None:
            cuda_graph.pool_id = pool
        key = cuda_graph.pool_id
        start, peak_before = mode.allocated, mode.peak
        mode.peak = start
        mode.capturing = True
        try:
            yield
        finally:
            mode.capturing = False
        kept = mode.peak - mode.allocated
        mode.graph_pools[key] = max(mode.graph_pools.get(key, 0), kept)
        mode.peak = max(peak_before, mode.peak)
        cuda_graph.captured = True


class _Stream:
    """A stream that orders nothing (every fake op is done when it returns)."""

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = torch.device(device) if device is not None else DEVICE

    def wait_stream(self, other: _Stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def fake_gpu(card: Card) -> Iterator[FakeGPU]:
    """Inside: one fake ``card`` as ``cuda:0``, under a FakeCudaMode."""
    _load_guard()
    gpu = FakeGPU(card)
    answers = dict(
        is_available=lambda: True,
        device_count=lambda: 1,
        current_device=lambda: 0,
        get_device_properties=gpu.properties,
        get_device_name=lambda device=None: card.name,
        get_device_capability=lambda device=None: card.capability,
        mem_get_info=gpu.mem_get_info,
        memory_allocated=lambda device=None: gpu.mode.allocated,
        max_memory_allocated=lambda device=None: gpu.mode.peak,
        reset_peak_memory_stats=gpu.reset_peak,
        synchronize=lambda device=None: None,
        empty_cache=lambda: None,
        Stream=_Stream,
        current_stream=lambda device=None: _Stream(device),
        stream=lambda stream: contextlib.nullcontext(),
        CUDAGraph=FakeCUDAGraph,
        graph=gpu.graph,
    )
    with mock.patch.multiple(torch.cuda, **answers), gpu.mode:
        yield gpu


@functools.cache
def _load_guard() -> None:
    source = Path(__file__).with_name("guard.cpp")
    include = Path(torch.__file__).parent / "include"
    lib = Path(torch.__file__).parent / "lib"
    key = hashlib.sha256(source.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    built = Path(tempfile.gettempdir()) / f"localserve-fake-cuda-guard-{key}.so"
    if not built.exists():
        partial = built.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([os.environ.get("CXX", "c++"), "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{include}",
                        str(source), f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}", "-o", str(partial)],
                       check=True, timeout=300, capture_output=True)
        partial.replace(built)
    ctypes.CDLL(str(built), mode=ctypes.RTLD_GLOBAL)
