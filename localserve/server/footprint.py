"""How much memory a model takes: measured for a loaded one (``/api/ps``), estimated
from metadata before a load (so the manager can unload idle models first)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.config import EngineConfig
from ..engine.engine import pick_device, pick_dtype
from ..engine.kv_cache import kv_bytes_per_block
from ..engine.memory import pool_sizes
from ..engine.speculative.draft_model import planned_sizes
from ..errors import LocalserveError
from ..formats import open_checkpoint
from ..formats.weights import weight_sizes

if TYPE_CHECKING:
    from ..engine.engine import Engine


def memory_footprint(engine: Engine) -> dict[str, int | str]:
    """Bytes the loaded ``engine`` holds: weights on its device and in host memory
    (cpu_moe experts), and its KV cache tiers; a draft model's weights and cache with the
    device's."""
    weights = weight_sizes(engine.checkpoint, engine.dtype)
    host_weights = weights.host_expert_bytes(engine.config.cpu_moe_layers(engine.spec.num_layers))
    block_bytes = kv_bytes_per_block(engine.spec, engine.config.block_size, engine.kv_dtype)
    draft_weights = draft_block_bytes = 0
    if engine.draft is not None:
        draft_weights = weight_sizes(engine.draft.checkpoint, engine.dtype).loaded_bytes
        draft_block_bytes = engine.draft.block_bytes(engine.config.block_size)
    return {
        "device": str(engine.device),
        "weights_bytes": weights.loaded_bytes - host_weights + draft_weights,
        "host_weights_bytes": host_weights,
        "kv_cache_bytes": engine.kv.device.num_blocks * (block_bytes + draft_block_bytes),
        "cpu_kv_cache_bytes": engine.kv.cpu.num_blocks * block_bytes,
    }


def needed_bytes(path: Path, engine: EngineConfig, device: str | None, dtype_name: str | None) -> int | None:
    """Host memory a CPU load of ``path`` would take (weights, KV pool, CPU tier);
    None on a GPU host, where the engine measures free device memory itself."""
    import torch

    if pick_device(device).type != "cpu":
        return None
    try:
        checkpoint = open_checkpoint(path)
    except LocalserveError:
        return None  # the load itself reports what is wrong with the file
    dtype = pick_dtype(dtype_name, checkpoint.spec.torch_dtype, torch.device("cpu"))
    weights = weight_sizes(checkpoint, dtype).loaded_bytes
    kv_dtype = engine.resolve_kv_cache_dtype(dtype, torch.device("cpu"), checkpoint.quantized_gguf)
    try:  # a draft model: its weights, and its blocks beside the pool's
        draft_weights, draft_block_bytes, _ = planned_sizes(engine, dtype, torch.device("cpu"))
    except LocalserveError:
        return None
    weights += draft_weights
    pools = pool_sizes(engine, checkpoint.spec, kv_dtype, "cpu", gpu_budget=lambda: 0,
                       companion_block_bytes=draft_block_bytes)
    return weights + pools.total_bytes + pools.device_blocks * draft_block_bytes
