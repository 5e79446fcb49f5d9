"""Engine options (what `LLM(...)` and `localserve serve` accept)."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..errors import LocalserveError
from .speculative.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# kv_cache_dtype names: "auto" is the model's dtype (see resolve_kv_cache_dtype); fp16 and bf16 store K/V in half the
# bytes of an fp32 model's (the CPU's kernels widen them as they read); int8 and fp8 make
# an 8-bit cache with a scale per token and head. The torch dtype of each choice, by name:
# the CLI reads this table without importing torch.
KV_CACHE_DTYPES = {"auto": None, "fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "int8",
                   "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}

# More threads than this is a typo, not a machine (cpu_threads uses at most the CPUs there are).
MAX_THREADS = 4096


@functools.cache  # once per process: cpu_threads is asked at every load and by the start-up summary
def _note_fewer_threads(asked: int, usable: int) -> None:
    log.warning("threads %d is more than the %d CPUs this process may use: running %d", asked, usable, usable)


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV cache block
    max_num_seqs: int = 64  # sequences in one step at most
    # Tokens (prefill chunks + decodes) in one step at most; default: 512 on the CPU, 2048 on a GPU.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # default: the model's context, capped to what the pool holds
    num_kv_blocks: int | None = None  # exact pool size; overrides kv_cache_memory
    # Bytes for the KV pool; default: measured on CUDA; on the CPU room for max_num_seqs
    # sequences of the context, within a quarter of the free memory (memory.cpu_default_budget).
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.90  # share of the GPU's memory localserve may use in all
    cpu_offload_gb: float = 0.0  # GiB of host memory for the CPU tier (swapped requests, spilled prefixes)
    num_cpu_blocks: int | None = None  # exact CPU-tier size; overrides cpu_offload_gb
    enable_prefix_caching: bool = True  # share the KV of equal prompt prefixes across requests
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), fp16, bf16, int8, or fp8 (e4m3; CUDA needs 8.9+)
    cpu_moe: int | str = 0  # MoE experts kept in host RAM and run on the CPU: of the first N layers, or "all"
    # CPU matmuls with fp32 activations for every quantized weight, instead of rounding x to
    # int8 for GGUF's types as llama.cpp does (slower; for comparing with a dense reference).
    # LOCALSERVE_EXACT_CPU_MATMUL=1 sets the default.
    exact_cpu_matmul: bool = field(default_factory=lambda: os.environ.get("LOCALSERVE_EXACT_CPU_MATMUL") == "1")
    # The torch references instead of the compiled CPU kernels / the Triton kernels (for
    # comparing with a kernel's definition); LOCALSERVE_DISABLE_CPU_KERNELS=1 and
    # LOCALSERVE_DISABLE_TRITON=1 set the defaults.
    disable_cpu_kernels: bool = field(
        default_factory=lambda: os.environ.get("LOCALSERVE_DISABLE_CPU_KERNELS") == "1")
    disable_triton: bool = field(default_factory=lambda: os.environ.get("LOCALSERVE_DISABLE_TRITON") == "1")
    # Decode steps run eagerly instead of replaying the CUDA graphs captured at load (for
    # debugging, or to skip the capture's seconds at start); LOCALSERVE_DISABLE_CUDA_GRAPHS=1
    # sets the default.
    disable_cuda_graphs: bool = field(
        default_factory=lambda: os.environ.get("LOCALSERVE_DISABLE_CUDA_GRAPHS") == "1")
    threads: int | None = None  # CPU threads for the kernels and torch; default: the physical cores we may use
    # A folder where GGUF models' weights, once converted to the CPU kernels' layout, are
    # kept and mapped at the next load instead of converted again (engine/prepared_store.py);
    # None: convert at every load. The daemon and the CLI use <home>/prepared.
    prepared_cache: str | None = None
    # Speculative decoding (engine/speculative/): the drafter and how many tokens each
    # request drafts by default (num_tokens 0: none unless a request asks).
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        checks = [
            (self.block_size > 0 and self.block_size & (self.block_size - 1) == 0, "block_size must be a power of two"),
            (self.max_num_seqs >= 1, "max_num_seqs must be at least 1"),
            (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             "max_num_batched_tokens must be at least 1"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be at least 1"),
            (self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be at least 1"),
            (self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory must be positive"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]"),
            (self.cpu_offload_gb >= 0, "cpu_offload_gb must not be negative"),
            (self.num_cpu_blocks is None or self.num_cpu_blocks >= 0, "num_cpu_blocks must not be negative"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}"),
            (self.threads is None or 1 <= self.threads <= MAX_THREADS, f"threads must be from 1 to {MAX_THREADS}"),
            (self.cpu_moe == "all" or (type(self.cpu_moe) is int and self.cpu_moe >= 0),
             f"cpu_moe must be a number of layers or 'all', not {self.cpu_moe!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise LocalserveError(f"invalid engine option: {message}")

    def step_tokens(self, device_type: str) -> int:
        """``max_num_batched_tokens``, or its default for this kind of device.

        A CPU step's activations grow with its tokens while its matmuls stop getting faster
        past a few hundred rows (each row already reuses every weight tile it loads), so the
        CPU takes 512-token steps, as llama.cpp's default micro-batch; a GPU fills its SMs
        with bigger ones."""
        return self.max_num_batched_tokens or (512 if device_type == "cpu" else 2048)

    def for_device(self, device_type: str) -> EngineConfig:
        """These options with the defaults that depend on the device filled in."""
        return replace(self, max_num_batched_tokens=self.step_tokens(device_type))

    def cpu_threads(self) -> int:
        """``threads``, or the physical cores of the CPUs this process may run on; never
        more threads than those CPUs: more only take turns on them (each parallel region
        waits for its slowest thread), and tens of thousands crash OpenMP."""
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if self.threads is None:
            import psutil

            return max(1, min(psutil.cpu_count(logical=False) or usable, usable))
        if self.threads > usable:
            _note_fewer_threads(self.threads, usable)
        return min(self.threads, usable)

    def cpu_moe_layers(self, num_layers: int) -> int:
        """How many leading layers keep their experts in host memory."""
        return num_layers if self.cpu_moe == "all" else min(int(self.cpu_moe), num_layers)

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype, device: torch.device | None = None,
                               quantized_gguf: bool = False) -> torch.dtype:
        """The cache's torch dtype for a model computing in ``model_dtype``; with a
        ``device``, checked to be one it can use. ``auto`` is the model's dtype, except for a
        GGUF file of quantized weights on the CPU: fp16, llama.cpp's own default there (half the
        bytes of fp32 for every token of context, read back at every step), unless
        ``exact_cpu_matmul`` asks for fp32 throughout."""
        import torch

        chosen = KV_CACHE_DTYPES[self.kv_cache_dtype]
        on_cpu = device is not None and torch.device(device).type == "cpu"
        if chosen is None and quantized_gguf and on_cpu and model_dtype == torch.float32 and not self.exact_cpu_matmul:
            chosen = "float16"
        dtype = getattr(torch, chosen) if chosen else model_dtype
        # Triton converts to float8 e4m3 only on compute capability 8.9+ (Ada, Hopper).
        if (dtype == torch.float8_e4m3fn and device is not None and device.type == "cuda"
                and torch.cuda.get_device_capability(device) < (8, 9)):
            raise LocalserveError("kv_cache_dtype fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper); "
                                  "use int8")
        return dtype
