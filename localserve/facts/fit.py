"""Will a model fit? Memory planning from a checkpoint's metadata alone (``localserve fit``).

Nothing is loaded: the spec comes from config.json or the GGUF header, and each
tensor's size from the safetensors headers or the GGUF tensor directory. The plan
follows the engine's own rule (``engine/memory.py``'s ``pool_sizes``): unless the
options fix it, the KV pool gets ``gpu_memory_utilization`` of the GPU less the
weights, one step's activations (and the CUDA graphs') and the CUDA overhead, and a sequence of ``context``
tokens needs whole blocks. Where
the engine measures (activations, CUDA overhead) the plan estimates, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.config import EngineConfig
from ..engine.engine import pick_dtype
from ..engine.memory import (CUDA_OVERHEAD_ESTIMATE, context_limit, cuda_graph_bytes, estimate_activation_peak,
                             pool_sizes)
from ..formats import ModelSpec, open_checkpoint
from ..formats.weights import WeightSizes, weight_sizes
from ..units import human_bytes
from .checkpoint import describe_parameters


@dataclass(slots=True, frozen=True)
class FitPlan:
    spec: ModelSpec
    weights: WeightSizes
    dtype: torch.dtype  # unquantized weights and activations
    kv_dtype: torch.dtype
    kv_bytes_per_token: int
    block_size: int
    context: int  # tokens per sequence planned for
    gpu_memory: int
    usable: int  # gpu_memory x gpu_memory_utilization
    activation_bytes: int  # estimated: the largest step's and the decode CUDA graphs'
    overhead_bytes: int  # CUDA context etc., estimated
    kv_budget: int  # bytes for the KV pool (may be negative: the weights alone do not fit)
    kv_blocks: int
    cpu_blocks: int
    cpu_moe_layers: int  # leading layers whose experts stay in host memory
    host_expert_bytes: int  # their loaded bytes

    @property
    def gpu_weight_bytes(self) -> int:
        return self.weights.loaded_bytes - self.host_expert_bytes

    @property
    def active_parameters(self) -> int:
        """Parameters one token runs through: all but the experts its router skips."""
        return self.spec.parameter_counts().active

    @property
    def blocks_per_sequence(self) -> int:
        return -(-self.context // self.block_size)

    @property
    def max_sequences(self) -> int:
        """Sequences of the full context that the device pool holds at once."""
        return self.kv_blocks // self.blocks_per_sequence

    @property
    def cpu_sequences(self) -> int:
        """Further full-context sequences the CPU tier can hold while swapped out."""
        return self.cpu_blocks // self.blocks_per_sequence

    @property
    def largest_context(self) -> int:
        """The longest single sequence the device pool holds."""
        return self.kv_blocks * self.block_size

    @property
    def fits(self) -> bool:
        return self.max_sequences >= 1

    def summary(self) -> dict[str, object]:
        """The figures, for scripts (``localserve fit --json``)."""
        return {
            "architecture": self.spec.architecture,
            "parameters": self.weights.parameters,
            "active_parameters": self.active_parameters,
            "weights_file_bytes": self.weights.file_bytes,
            "weights_loaded_bytes": self.weights.loaded_bytes,
            "weights_gpu_bytes": self.gpu_weight_bytes,
            "experts_host_bytes": self.host_expert_bytes,
            "cpu_moe_layers": self.cpu_moe_layers,
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "context": self.context,
            "gpu_memory": self.gpu_memory,
            "usable_bytes": self.usable,
            "activation_bytes_estimate": self.activation_bytes,
            "cuda_overhead_bytes_estimate": self.overhead_bytes,
            "kv_cache_bytes": max(0, self.kv_budget),
            "kv_blocks": self.kv_blocks,
            "fits": self.fits,
            "max_sequences": self.max_sequences,
            "largest_context": self.largest_context,
            "cpu_blocks": self.cpu_blocks,
            "cpu_sequences": self.cpu_sequences,
        }


def plan(path: str | Path, gpu_memory: int, config: EngineConfig | None = None,
         dtype: str | torch.dtype | None = None) -> FitPlan:
    """The plan for serving the checkpoint at ``path`` on a GPU of ``gpu_memory`` bytes
    with these engine options (``max_model_len`` is the context planned for)."""
    config = config or EngineConfig()
    checkpoint = open_checkpoint(path)
    spec = checkpoint.spec
    model_dtype = pick_dtype(dtype, spec.torch_dtype, torch.device("cuda"))
    weights = weight_sizes(checkpoint, model_dtype)
    # No device: whether fp8 runs depends on the GPU planned for, not on this host's.
    kv_dtype = config.resolve_kv_cache_dtype(model_dtype)
    context = context_limit(spec, config.max_model_len)
    step_tokens = min(config.step_tokens("cuda"), context)
    # The largest step's activations, and what the decode CUDA graphs keep.
    activations = (estimate_activation_peak(spec, step_tokens, config.max_num_seqs, model_dtype)
                   + cuda_graph_bytes(config, spec, model_dtype, context))
    usable = int(gpu_memory * config.gpu_memory_utilization)
    cpu_moe_layers = config.cpu_moe_layers(spec.num_layers)
    host_expert_bytes = weights.host_expert_bytes(cpu_moe_layers)
    # What the GPU has left once the weights, activations and CUDA are in (may be negative).
    left = usable - (weights.loaded_bytes - host_expert_bytes) - activations - CUDA_OVERHEAD_ESTIMATE
    pools = pool_sizes(config, spec, kv_dtype, "cuda", lambda: left)
    return FitPlan(
        spec=spec, weights=weights, dtype=model_dtype, kv_dtype=kv_dtype,
        kv_bytes_per_token=pools.block_bytes // config.block_size, block_size=config.block_size, context=context,
        gpu_memory=gpu_memory, usable=usable, activation_bytes=activations, overhead_bytes=CUDA_OVERHEAD_ESTIMATE,
        kv_budget=pools.device_budget, kv_blocks=pools.device_blocks,
        cpu_blocks=pools.cpu_blocks, cpu_moe_layers=cpu_moe_layers, host_expert_bytes=host_expert_bytes,
    )


def describe(plan: FitPlan, name: str) -> list[tuple[str, str]]:
    """The plan as (label, text) lines for people."""
    spec, weights = plan.spec, plan.weights

    def dtype_name(dtype: torch.dtype) -> str:
        return str(dtype).removeprefix("torch.")

    parameters = describe_parameters(spec)
    lines = [
        ("model", f"{name} ({spec.architecture}, {spec.num_layers} layers, {spec.num_heads} heads, "
                  f"{spec.num_kv_heads} KV heads of {spec.head_dim})"),
        ("parameters", parameters),
        ("weights", f"{human_bytes(weights.loaded_bytes)} loaded ({human_bytes(weights.file_bytes)} in the file; "
                    f"unquantized tensors as {dtype_name(plan.dtype)})"),
        ("KV cache", f"{human_bytes(plan.kv_bytes_per_token)} per token ({dtype_name(plan.kv_dtype)}), "
                     f"{human_bytes(plan.kv_bytes_per_token * plan.context)} per {plan.context:,}-token sequence"),
        ("GPU memory", f"{human_bytes(plan.usable)} usable ({human_bytes(plan.gpu_memory)} x {plan.usable / plan.gpu_memory:.2f}): "
                       f"weights {human_bytes(plan.gpu_weight_bytes)}, activations ~{human_bytes(plan.activation_bytes)}, "
                       f"CUDA ~{human_bytes(plan.overhead_bytes)}, KV cache {human_bytes(max(0, plan.kv_budget))}"),
    ]
    if plan.cpu_moe_layers and spec.num_experts:
        lines.append(("host memory", f"{human_bytes(plan.host_expert_bytes)} of experts (cpu_moe: layers "
                                     f"0-{plan.cpu_moe_layers - 1} of {spec.num_layers}) run on the CPU"))
    if plan.fits:
        lines.append(("fits", f"yes: {plan.max_sequences:,} sequences of {plan.context:,} tokens at once "
                              f"({plan.kv_blocks * plan.block_size:,} tokens of KV cache)"))
    elif plan.kv_budget <= 0:
        lines.append(("fits", f"no: weights, activations and CUDA overhead alone need "
                              f"{human_bytes(plan.usable - plan.kv_budget)} of the {human_bytes(plan.usable)} usable"))
    else:
        lines.append(("fits", f"no: the KV cache holds {plan.largest_context:,} tokens, less than one "
                              f"{plan.context:,}-token sequence; lower max_model_len or use kv_cache_dtype int8"))
    if plan.cpu_blocks:
        lines.append(("CPU offload", f"{plan.cpu_sequences:,} more sequences held in host memory while swapped out "
                                     f"({plan.cpu_blocks * plan.block_size:,} tokens)"))
    return lines
