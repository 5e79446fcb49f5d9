"""Will a model fit? Memory planning from a checkpoint's metadata alone (``localserve fit``).

Nothing is loaded: the spec comes from config.json or the GGUF header, and each
tensor's size from the safetensors headers or the GGUF tensor directory. The plan
follows the engine's own rule (``engine/memory.py``'s ``pool_sizes``): unless the
options fix it, on a GPU the KV pool gets ``gpu_memory_utilization`` of its memory less
the weights, one step's activations (and the CUDA graphs') and the CUDA overhead; on the
CPU (a host without a GPU, and no --gpu-memory) the CPU's default pool, within the
host's available memory less the weights and activations. A sequence of ``context``
tokens needs whole blocks, and no more than ``max_num_seqs`` run at once. Where the
engine measures (activations, CUDA overhead, free memory) the plan estimates, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine import memory
from ..engine.config import EngineConfig
from ..engine.engine import pick_dtype
from ..engine.speculative.draft_model import planned_sizes
from ..engine.memory import (CUDA_OVERHEAD_ESTIMATE, context_limit, cuda_graph_bytes, estimate_activation_peak,
                             planned_context, pool_sizes)
from ..formats import Checkpoint, ModelSpec, open_checkpoint
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
    max_context: int  # the longest the engine serves: max_model_len, else the model's own
    max_num_seqs: int  # sequences one step runs at most
    device: str  # "cuda" or "cpu"
    memory: int  # the GPU's memory, or the host's available memory
    memory_source: str  # where ``memory`` comes from
    usable: int  # memory x gpu_memory_utilization on a GPU; all of it on the CPU
    activation_bytes: int  # estimated: the largest step's (or image encoder batch's) and the decode CUDA graphs'
    overhead_bytes: int  # CUDA context etc., estimated (0 on the CPU)
    room: int  # what the memory has left for the KV pool once the rest is in (negative: not even that fits)
    kv_budget: int  # bytes for the KV pool (may be negative: the weights alone do not fit)
    kv_reason: str  # how the pool was sized
    kv_blocks: int
    cpu_blocks: int
    cpu_moe_layers: int  # leading layers whose experts stay in host memory
    host_expert_bytes: int  # their loaded bytes
    draft_weight_bytes: int = 0  # a draft model's (speculative decoding), beside the model's
    draft_kv_bytes_per_token: int = 0  # its cache, one block beside each of the pool's
    image_activation_bytes: int = 0  # estimated: one image encoder batch's (0: the model reads no images)

    @property
    def gpu_weight_bytes(self) -> int:
        """The weights in the device's memory (on the CPU, all of them)."""
        return self.weights.loaded_bytes - self.host_expert_bytes

    @property
    def active_parameters(self) -> int:
        """Parameters one token runs through: all but the experts its router skips."""
        return self.spec.parameter_counts().active

    @property
    def blocks_per_sequence(self) -> int:
        return -(-self.context // self.block_size)

    @property
    def pool_sequences(self) -> int:
        """Sequences of the full context that the device pool could hold."""
        return self.kv_blocks // self.blocks_per_sequence

    @property
    def max_sequences(self) -> int:
        """Sequences of the full context served at once: as many as the pool holds, at
        most ``max_num_seqs``."""
        return min(self.pool_sequences, self.max_num_seqs)

    @property
    def cpu_sequences(self) -> int:
        """Further full-context sequences the CPU tier holds while swapped out: only
        running ones are swapped, so with them at most ``max_num_seqs``."""
        return min(self.cpu_blocks // self.blocks_per_sequence, self.max_num_seqs - self.max_sequences)

    @property
    def largest_context(self) -> int:
        """The longest single sequence the device pool holds and the engine serves."""
        return min(self.kv_blocks * self.block_size, self.max_context)

    @property
    def fits(self) -> bool:
        return self.max_sequences >= 1 and self.kv_budget <= self.room

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
            "device": self.device,
            "memory": self.memory,
            "memory_source": self.memory_source,
            "usable_bytes": self.usable,
            "activation_bytes_estimate": self.activation_bytes,
            "cuda_overhead_bytes_estimate": self.overhead_bytes,
            "kv_cache_bytes": max(0, self.kv_budget),
            "kv_cache_sized": self.kv_reason,
            "kv_blocks": self.kv_blocks,
            "fits": self.fits,
            "max_num_seqs": self.max_num_seqs,
            "max_sequences": self.max_sequences,
            "largest_context": self.largest_context,
            "cpu_blocks": self.cpu_blocks,
            "cpu_sequences": self.cpu_sequences,
            "draft_weights_bytes": self.draft_weight_bytes,
            "draft_kv_bytes_per_token": self.draft_kv_bytes_per_token,
            "image_activation_bytes_estimate": self.image_activation_bytes,
        }


def plan(path: str | Path, gpu_memory: int | None = None, config: EngineConfig | None = None,
         dtype: str | torch.dtype | None = None) -> FitPlan:
    """The plan for serving the checkpoint at ``path`` on a GPU of ``gpu_memory`` bytes,
    or with None on this host's CPU and available memory, with these engine options
    (``max_model_len`` is the context planned for)."""
    config = config or EngineConfig()
    device = "cpu" if gpu_memory is None else "cuda"
    checkpoint = open_checkpoint(path)
    spec = checkpoint.spec
    model_dtype = pick_dtype(dtype, spec.torch_dtype, torch.device(device))
    weights = weight_sizes(checkpoint, model_dtype)
    # No device for a GPU plan: whether fp8 runs depends on the GPU planned for, not on this host's.
    kv_dtype = config.resolve_kv_cache_dtype(model_dtype, torch.device("cpu") if device == "cpu" else None,
                                             checkpoint.quantized_gguf)
    context = planned_context(spec, config, device)
    step_tokens = min(config.step_tokens(device), context)
    # An image encoder batch runs before a step's forward, not beside it: the larger counts.
    image_activations = _image_activation_bytes(checkpoint, model_dtype)
    activations = max(estimate_activation_peak(spec, step_tokens, config.max_num_seqs, model_dtype), image_activations)
    draft = planned_sizes(config, model_dtype, torch.device("cpu") if device == "cpu" else None)
    if gpu_memory is not None:
        total, source = gpu_memory, "the GPU's memory"
        usable, overhead = int(gpu_memory * config.gpu_memory_utilization), CUDA_OVERHEAD_ESTIMATE
        # What the CUDA graphs keep (the draft model's too).
        activations += cuda_graph_bytes(config, spec, model_dtype, context, draft.hidden_size)
        cpu_moe_layers = config.cpu_moe_layers(spec.num_layers)
    else:  # all in host memory: no share of it to leave, no CUDA, no experts apart
        host = memory.available_host_memory()
        total, source, usable, overhead, cpu_moe_layers = host.available, host.source, host.available, 0, 0
    host_expert_bytes = weights.host_expert_bytes(cpu_moe_layers)
    draft_weights, draft_block_bytes = draft.weights, draft.block_bytes
    # What the memory has left once the weights, activations and CUDA are in (may be negative).
    room = usable - (weights.loaded_bytes - host_expert_bytes) - draft_weights - activations - overhead
    pools = pool_sizes(config, spec, kv_dtype, device, lambda: room, host_free=lambda: room,
                       companion_block_bytes=draft_block_bytes)
    return FitPlan(
        spec=spec, weights=weights, dtype=model_dtype, kv_dtype=kv_dtype,
        kv_bytes_per_token=pools.block_bytes // config.block_size, block_size=config.block_size, context=context,
        max_context=context_limit(spec, config.max_model_len), max_num_seqs=config.max_num_seqs, device=device,
        memory=total, memory_source=source, usable=usable, activation_bytes=activations, overhead_bytes=overhead,
        room=room, kv_budget=pools.device_budget, kv_reason=pools.reason, kv_blocks=pools.device_blocks,
        cpu_blocks=pools.cpu_blocks, cpu_moe_layers=cpu_moe_layers, host_expert_bytes=host_expert_bytes,
        draft_weight_bytes=draft_weights, draft_kv_bytes_per_token=draft_block_bytes // config.block_size,
        image_activation_bytes=image_activations,
    )


def _image_activation_bytes(checkpoint: Checkpoint, dtype: torch.dtype) -> int:
    if not checkpoint.reads_images:
        return 0
    from ..vision.config import read_image_config
    from ..vision.footprint import encoder_activation_bytes

    config = read_image_config(checkpoint)
    return 0 if config is None else encoder_activation_bytes(config, dtype)


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
    ]
    kv_cache = human_bytes(max(0, plan.kv_budget))
    if plan.device == "cuda":
        lines.append(("GPU memory", f"{human_bytes(plan.usable)} usable ({human_bytes(plan.memory)} x "
                                    f"{plan.usable / plan.memory:.2f}): weights {human_bytes(plan.gpu_weight_bytes)}, "
                                    f"activations ~{human_bytes(plan.activation_bytes)}, "
                                    f"CUDA ~{human_bytes(plan.overhead_bytes)}, KV cache {kv_cache}"))
    else:
        lines.append(("host memory", f"{human_bytes(plan.memory)} available ({plan.memory_source}; no GPU): "
                                     f"weights {human_bytes(plan.gpu_weight_bytes)}, activations "
                                     f"~{human_bytes(plan.activation_bytes)}, KV cache {kv_cache} ({plan.kv_reason})"))
    if plan.image_activation_bytes:
        lines.append(("images", f"the vision tower's weights are in the weights above; an encoder batch's "
                                f"activations ~{human_bytes(plan.image_activation_bytes)}, within the activations"))
    if plan.draft_weight_bytes:
        lines.append(("draft model", f"{human_bytes(plan.draft_weight_bytes)} of weights; its KV cache "
                                     f"{human_bytes(plan.draft_kv_bytes_per_token)} per token, beside the model's "
                                     f"in the same budget"))
    if plan.cpu_moe_layers and spec.num_experts:
        lines.append(("host memory", f"{human_bytes(plan.host_expert_bytes)} of experts (cpu_moe: layers "
                                     f"0-{plan.cpu_moe_layers - 1} of {spec.num_layers}) run on the CPU"))
    pool_tokens = f"{plan.kv_blocks * plan.block_size:,} tokens of KV cache"
    if plan.fits and plan.pool_sequences > plan.max_num_seqs:
        lines.append(("fits", f"yes: {plan.max_sequences:,} sequences of {plan.context:,} tokens at once, the "
                              f"max_num_seqs limit (the {pool_tokens} would hold {plan.pool_sequences:,})"))
    elif plan.fits:
        lines.append(("fits", f"yes: {plan.max_sequences:,} sequences of {plan.context:,} tokens at once "
                              f"({pool_tokens})"))
    elif plan.room <= 0:
        rest = "weights, activations and CUDA overhead" if plan.device == "cuda" else "weights and activations"
        lines.append(("fits", f"no: {rest} alone need {human_bytes(plan.usable - plan.room)} of the "
                              f"{human_bytes(plan.usable)} {'usable' if plan.device == 'cuda' else 'available'}"))
    elif plan.kv_budget > plan.room:
        lines.append(("fits", f"no: a KV cache of {kv_cache} ({plan.kv_reason}) is more than the "
                              f"{human_bytes(plan.room)} the rest leaves"))
    else:
        lines.append(("fits", f"no: the KV cache holds {plan.largest_context:,} tokens, less than one "
                              f"{plan.context:,}-token sequence; lower max_model_len or use kv_cache_dtype int8"))
    if plan.cpu_blocks:
        held = plan.cpu_blocks // plan.blocks_per_sequence
        limit = "" if plan.cpu_sequences == held else f"; the max_num_seqs limit, the tier would hold {held:,}"
        lines.append(("CPU offload", f"{plan.cpu_sequences:,} more sequences held in host memory while swapped out "
                                     f"({plan.cpu_blocks * plan.block_size:,} tokens{limit})"))
    return lines
