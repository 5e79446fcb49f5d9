"""How many KV blocks the device and the CPU tier hold: ``pool_sizes``, the one rule
the engine, ``localserve fit`` (facts/fit.py) and the daemon's memory estimate
(server/footprint.py) all follow.

``num_kv_blocks`` fixes the device pool; else ``kv_cache_memory`` its bytes; else on the
CPU room for ``max_num_seqs`` sequences of the context asked for, within a share of the
host's free memory (``cpu_default_budget``); and on CUDA what is left of
``gpu_memory_utilization`` of the GPU's memory after everything already there (our
weights, other processes, the CUDA context) and after the peak activations of the largest
step (measured by the engine, estimated by the planner). The CPU tier is
``num_cpu_blocks``, else ``cpu_offload_gb`` in blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import InsufficientMemoryError, LocalserveError
from ..formats.spec import ModelSpec
from ..formats.weights import WeightSizes
from ..units import human_bytes
from .config import EngineConfig
from .host_memory import available_host_memory
from .cuda_graphs import StaticInputs, graph_shapes, why_eager
from .kv_cache import allocate_kv_tensors, kv_bytes_per_block
from .runner import scratch_prefill

log = logging.getLogger(__name__)

GiB = 1 << 30

# The CPU's default pool (cpu_default_budget). Without max_model_len it is sized for
# contexts of at most CPU_DEFAULT_CONTEXT tokens: a CPU prefills a few hundred tokens a
# second, so longer prompts take minutes, and a checkpoint may declare 128K or 2**28
# positions. It never takes more than CPU_KV_SHARE_OF_FREE of the memory free once the
# weights are in: the rest is for the steps' activations, the CPU tier, the other models
# the daemon loads and the rest of the host.
CPU_DEFAULT_CONTEXT = 8192
CPU_KV_SHARE_OF_FREE = 0.25


# What the CUDA context, cuBLAS workspaces and allocator slack take besides tensors: an
# estimate for planning only (the engine measures the real figure).
CUDA_OVERHEAD_ESTIMATE = 512 << 20


@dataclass(frozen=True, slots=True)
class PoolSizes:
    """The KV pools in blocks of ``block_bytes``: on the device and in the CPU tier, the
    bytes the device pool was given (negative when a GPU has none left), and why (for the
    engine's log line and ``fit``)."""

    block_bytes: int
    device_blocks: int
    cpu_blocks: int
    device_budget: int
    reason: str

    @property
    def total_bytes(self) -> int:
        return (self.device_blocks + self.cpu_blocks) * self.block_bytes


def pool_sizes(config: EngineConfig, spec: ModelSpec, kv_dtype: torch.dtype, device_type: str,
               gpu_budget: Callable[[], int], host_free: Callable[[], int] | None = None,
               companion_block_bytes: int = 0) -> PoolSizes:
    """The pools the options give (see the module doc). Only when no option fixes the
    device pool's size, ``gpu_budget`` is asked for the bytes a CUDA device has left for
    it, and on the CPU ``host_free`` for the host's free bytes (default: what
    ``available_host_memory`` reads now). ``companion_block_bytes``: each device block
    comes with one of a draft model's pool, paid from the same budget."""
    block_bytes = kv_bytes_per_block(spec, config.block_size, kv_dtype)
    paired_bytes = block_bytes + companion_block_bytes
    if config.num_kv_blocks is not None:
        budget, reason = config.num_kv_blocks * block_bytes, "num_kv_blocks set"
    elif config.kv_cache_memory is not None:
        budget, reason = config.kv_cache_memory, "kv_cache_memory set"
    elif device_type != "cuda":
        free = host_free() if host_free is not None else available_host_memory().available
        budget, reason = cpu_default_budget(config, spec, paired_bytes, free)
    else:
        budget, reason = gpu_budget(), "what gpu_memory_utilization leaves"
    cpu_blocks = config.num_cpu_blocks
    if cpu_blocks is None:
        cpu_blocks = int(config.cpu_offload_gb * GiB) // block_bytes
    device_blocks = config.num_kv_blocks if config.num_kv_blocks is not None else max(0, budget) // paired_bytes
    return PoolSizes(block_bytes, device_blocks, cpu_blocks, budget, reason)


def cpu_default_budget(config: EngineConfig, spec: ModelSpec, block_bytes: int, free: int) -> tuple[int, str]:
    """The CPU's default pool in bytes, and why: whole blocks for ``max_num_seqs``
    sequences of the planned context (every sequence a step may run, each as long as it
    may get), but no more than CPU_KV_SHARE_OF_FREE of the ``free`` bytes; yet at least
    one such sequence when that takes at most half of them, so that one request of the
    full context runs wherever it can."""
    context = planned_context(spec, config, "cpu")
    sequence = -(-context // config.block_size) * block_bytes
    wanted = config.max_num_seqs * sequence
    share = int(max(0, free) * CPU_KV_SHARE_OF_FREE)
    share_text = f"{CPU_KV_SHARE_OF_FREE:.0%} of {human_bytes(max(0, free))} free"
    sized_for = f"{config.max_num_seqs} sequences of {context:,} tokens"
    if wanted <= share:
        return wanted, f"sized for {sized_for}; {share_text} would allow more"
    if share >= sequence:
        return share, f"capped to {share_text}; {sized_for} would take {human_bytes(wanted)}"
    if sequence <= free // 2:
        return sequence, f"one sequence of {context:,} tokens, more than {share_text}"
    return share, (f"capped to {share_text}, less than one sequence of {context:,} tokens "
                   f"({human_bytes(sequence)}); lower max_model_len or free memory")


def planned_context(spec: ModelSpec, config: EngineConfig, device_type: str) -> int:
    """The context a sequence is planned for (the CPU's default pool, ``fit``):
    ``max_model_len``, else the model's own, on the CPU at most CPU_DEFAULT_CONTEXT."""
    context = context_limit(spec, config.max_model_len)
    if config.max_model_len is None and device_type != "cuda":
        context = min(context, CPU_DEFAULT_CONTEXT)
    return context


def most_pool_tokens(config: EngineConfig, spec: ModelSpec, kv_dtype: torch.dtype, device: torch.device) -> int:
    """The most tokens the device pool can ever hold, known before the model is built: the
    pool the options give, or on a GPU measured later, all of the GPU's memory. Tables the
    model sizes by the context (rotary cos/sin) need no more positions, whatever context a
    checkpoint declares. Pools larger than the memory there is are refused here, before
    anything is loaded (``check_pools_fit``)."""
    def whole_device() -> int:
        return torch.cuda.get_device_properties(device).total_memory

    pools = pool_sizes(config, spec, kv_dtype, device.type, whole_device)
    check_pools_fit(pools, device)
    return max(1, pools.device_blocks) * config.block_size


def check_pools_fit(pools: PoolSizes, device: torch.device) -> None:
    """Refuse a device pool larger than all of the device's memory (the host's RAM for the
    CPU) or a CPU tier larger than the host's RAM: options such as ``kv_cache_memory=1024TiB``
    would otherwise be handed to the allocator, which swaps for minutes or crashes."""
    import psutil

    host = psutil.virtual_memory().total
    on_device = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else host
    where = "the GPU's" if device.type == "cuda" else "this host's"
    if pools.device_budget > on_device:
        raise LocalserveError(f"a KV cache of {human_bytes(pools.device_budget)} ({pools.reason}) is more than all "
                              f"{human_bytes(on_device)} of {where} memory; ask for less")
    if pools.cpu_blocks * pools.block_bytes > host:
        raise LocalserveError(f"a CPU tier of {human_bytes(pools.cpu_blocks * pools.block_bytes)} is more than all "
                              f"{human_bytes(host)} of this host's memory; lower cpu_offload_gb (--cpu-offload-gb)")


def context_limit(spec: ModelSpec, max_model_len: int | None) -> int:
    """The longest context asked for (``max_model_len``) or the model's own. Dynamic NTK
    rope stretches to ``factor`` times the model's context, but only when asked: its
    rotary base follows the served context (models/rope.py), and at the model's own it is
    the pre-trained one."""
    own = spec.max_position_embeddings
    limit = int(own * spec.rope.factor) if spec.rope.kind == "dynamic" else own
    wanted = max_model_len or own
    if wanted > limit:
        raise LocalserveError(f"max_model_len {wanted} exceeds the model's context of {limit} tokens")
    return wanted


def estimate_activation_peak(spec: ModelSpec, num_tokens: int, max_num_seqs: int, dtype: torch.dtype) -> int:
    """Peak bytes of one step's activations, estimated from the shapes (for planning
    without a GPU; the engine profiles a real step instead): per token the residual
    stream and its three transforms, the fused QKV and the widest MLP (gate and up,
    then their product; the chosen experts' for MoE), and fp32 logits plus their
    softmax for the rows that sample."""
    item = torch.empty((), dtype=dtype).element_size()
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    if spec.num_experts:
        mlp = spec.num_experts_per_tok * spec.moe_intermediate_size + spec.shared_expert_intermediate_size
    else:
        mlp = spec.intermediate_size
    per_token = (4 * spec.hidden_size + qkv + 3 * mlp) * item
    logits = min(max_num_seqs, num_tokens) * spec.vocab_size * 4 * 2
    return num_tokens * per_token + logits


def cuda_graph_bytes(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, context: int,
                     draft_hidden_size: int = 0) -> int:
    """GPU memory the CUDA graphs keep (0 when none are captured), estimated from the
    shapes as the planner's activations are: their shared pool holds the activations of the
    largest graph's forward, each graph keeps its output rows, and all read one set of
    static inputs (block tables as wide as ``context``). A draft model (its hidden size
    given) has the same shapes captured, in the same pool: their outputs and inputs too."""
    if why_eager(config, spec.num_layers):
        return 0
    shapes = graph_shapes(config.max_num_seqs, config.speculative.num_tokens)
    rows = max(shape.rows for shape in shapes)
    outputs = sum(shape.rows for shape in shapes) * (spec.hidden_size + draft_hidden_size) * \
        torch.empty((), dtype=dtype).element_size()
    static_inputs = StaticInputs.nbytes(rows, max(shape.sequences for shape in shapes),
                                        -(-context // config.block_size)) * (2 if draft_hidden_size else 1)
    return estimate_activation_peak(spec, rows, 0, dtype) + outputs + static_inputs


def check_weights_fit(weights: WeightSizes, config: EngineConfig, num_layers: int, device: torch.device) -> None:
    """Refuse, before loading, weights the GPU cannot hold within ``gpu_memory_utilization``
    (a CUDA out-of-memory error halfway through the load would say less)."""
    on_gpu = weights.loaded_bytes - weights.host_expert_bytes(config.cpu_moe_layers(num_layers))
    free, total = torch.cuda.mem_get_info(device)
    allowed = int(total * config.gpu_memory_utilization) - (total - free)
    if on_gpu > allowed:
        advice = "a smaller quantization of the model"
        if weights.expert_bytes_by_layer:
            advice += ", or keep experts in host memory with cpu_moe (--cpu-moe)"
        raise InsufficientMemoryError(
            f"the weights need {on_gpu / GiB:.1f} GiB on the GPU; {max(0, allowed) / GiB:.1f} GiB of its "
            f"{total / GiB:.1f} GiB may be used ({config.gpu_memory_utilization:.0%}, less what is in use); "
            f"use {advice}")


def kv_budget_bytes(total: int, free: int, activation_peak: int, utilization: float, reserve: int = 0) -> int:
    """Bytes for the KV pool: the utilization share of ``total``, less what is in use
    now (``total - free``: weights, other processes, the CUDA context), the peak
    activations of a step and any other ``reserve`` (CUDA graphs)."""
    in_use = total - free
    budget = int(total * utilization) - in_use - activation_peak - reserve
    if budget <= 0:
        raise InsufficientMemoryError(
            f"no GPU memory left for the KV cache: {utilization:.0%} of {total / GiB:.1f} GiB allowed, "
            f"{in_use / GiB:.2f} GiB in use after loading the weights, {activation_peak / GiB:.2f} GiB for "
            "activations; raise gpu_memory_utilization, lower max_num_batched_tokens, or use a smaller model"
        )
    return budget


@torch.inference_mode()
def profile_activation_peak(model: torch.nn.Module, spec: ModelSpec, num_tokens: int, block_size: int,
                            kv_dtype: torch.dtype, device: torch.device, max_num_seqs: int) -> int:
    """Peak CUDA memory of one forward over ``num_tokens`` (the largest step), above
    what was allocated before it, not counting the scratch KV cache it writes."""
    num_blocks = -(-num_tokens // block_size)
    scratch = allocate_kv_tensors(spec, num_blocks, block_size, kv_dtype, device)
    inputs = scratch_prefill(num_tokens, list(range(num_blocks)), block_size, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    hidden = model(inputs.input_ids, inputs.positions, scratch, inputs.meta)
    # Sampling reads logits for up to max_num_seqs rows at once.
    model.compute_logits(hidden[: min(max_num_seqs, num_tokens)]).float().softmax(-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del scratch, hidden
    torch.cuda.empty_cache()
    return max(0, peak)


def measured_gpu_budget(config: EngineConfig, model: torch.nn.Module, spec: ModelSpec, kv_dtype: torch.dtype,
                        device: torch.device, max_model_len: int, draft_hidden_size: int = 0,
                        encoder_peak: int = 0) -> int:
    """The bytes a loaded model's GPU has left for the KV pool, its largest step measured,
    less what the CUDA graphs will keep (the draft model's too, given its hidden size).
    ``encoder_peak``: an image encoder batch's activations (estimated), which come before a
    step's forward, not beside it: the larger of the two is kept free."""
    step_tokens = min(config.step_tokens(device.type), max_model_len)
    peak = profile_activation_peak(model, spec, step_tokens, config.block_size, kv_dtype, device, config.max_num_seqs)
    peak = max(peak, encoder_peak)
    graphs = cuda_graph_bytes(config, spec, model.dtype, max_model_len, draft_hidden_size)
    free, total = torch.cuda.mem_get_info(device)
    budget = kv_budget_bytes(total, free, peak, config.gpu_memory_utilization, reserve=graphs)
    log.info("GPU memory: %.2f GiB total, %.2f GiB in use after loading, %.2f GiB peak activations, "
             "%.2f GiB for CUDA graphs; %.2f GiB for the KV cache", total / GiB, (total - free) / GiB, peak / GiB,
             graphs / GiB, budget / GiB)
    return budget
