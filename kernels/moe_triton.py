"""Triton fused MoE: the experts' SwiGLU MLPs as two grouped GEMMs over tokens sorted
by expert.

See ``moe.py`` for the interface and ``moe_ref.py`` for the definition of correct.

Why sort by expert. A token's ``k`` (token, expert) *pairs* each need a different
expert's weights. Run one GEMM per pair and every expert's weights are read once per
token that chose it; run one GEMM per expert and there are ``E`` launches, most of them
tiny. Instead the pairs are sorted by expert (``align_by_expert``) and each expert's run
is padded to a multiple of ``BLOCK_M``, so every block of ``BLOCK_M`` sorted pairs
belongs to one expert. One launch covers all blocks: program ``(m, n)`` reads block
``m``'s expert ``e``, gathers the block's input rows, and multiplies them by expert
``e``'s ``[BLOCK_N]`` output columns. An expert's weight tile is thus read once per block
of its tokens (once per step when decoding), and experts no token chose get no block
and cost nothing.

Padding and sentinels. The padding slots hold the sentinel pair id ``T * k``: their
rows load as zeros and are never stored. The number of blocks depends on the routing,
which only the GPU knows; to stay free of host synchronisation (CUDA graphs), the grid
is sized for the worst case and the blocks past the padded total carry the expert id
``-1``, on which their programs return at once.

The two GEMMs, per pair ``p = t * k + j`` (token ``t``, its ``j``-th expert):

1. ``h[p] = x[t] @ gate_up_e.T``: input row ``p // k``, one launch per ``gate_up`` part
   (fused ``[E, 2I, H]``, or gate and up apart), each into its columns of ``h [T*k, 2I]``.
2. ``y[p] = gates[p] * (silu(h_gate[p]) * h_up[p]) @ down_e.T``: input row ``p``; the
   SwiGLU in between is one elementwise torch op.

``y`` stays in pair order, so the ``k`` outputs of a token are summed in fp32 with one
reduction, without atomics (deterministic). Expert weights are dense ``[E, N, K]``
(addressed through strides) or a stacked QuantWeight (expert ``e``'s rows start at
``e * N``), dequantized tile by tile by ``quant_linear_triton._dequantize_tile``; GPTQ
act-order (``ExpertWeights.perms``) gathers the input columns through ``perms[e]`` in
the kernel, as the permutation differs per expert.

Only plain ``tl.load``/``tl.store``/``tl.dot`` are used, so the kernel runs on any
Triton 3.x GPU backend and under ``TRITON_INTERPRET=1``. The launch is the torch custom
op ``localserve::moe_gemm``, with a fake implementation (see attention_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .experts import ExpertMLP, ExpertWeights
from .quant_weight import QuantWeight
from .quant_linear_triton import _MIN_DOT_DIM, _dequantize_tile, _largest_pow2_divisor
from .quant_linear_triton import _choose_block_k as _choose_quant_block_k
from .quant_linear_triton import NUM_WARPS, quant_operands
from .quant_linear_triton import supports as _quant_supports

_MAX_BLOCK_M = 64
_BLOCK_N = 64
_MAX_BLOCK_K = 64
_DENSE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# block_experts' value for the blocks past the padded total: their programs return.
EXIT_EXPERT = -1


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
    """The (token, expert) pairs of ``ids [T, k]`` grouped by expert, each expert's run
    padded to a multiple of ``block_m``.

    Returns ``(sorted_pairs, block_experts, num_padded)``:

    - ``sorted_pairs`` int32 ``[capacity]``: pair ids ``p = t * k + j``, by expert
      (stably, so by token within an expert), each run followed by the sentinel
      ``T * k`` up to a multiple of ``block_m``, and sentinels after the last run;
    - ``block_experts`` int32 ``[capacity // block_m]``: the expert of each block of
      ``block_m`` slots, ``EXIT_EXPERT`` past the padded total;
    - ``num_padded`` int32 ``[1]``: the padded total, ``sum(ceil(count / block_m) * block_m)``.

    ``capacity`` is a bound known on the host: at most ``min(E, T*k)`` experts are
    chosen, each padded by fewer than ``block_m`` slots, so
    ``T*k + min(E, T*k) * (block_m - 1)``, rounded up to a whole block. Only tensor ops
    on ``ids``' device, no host synchronisation, so this can be captured in a CUDA graph.
    """
    device = ids.device
    flat = ids.reshape(-1).to(torch.int64)  # scatter/index ops take int64 indices
    num_pairs = flat.numel()
    capacity = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    # Counts by scatter_add rather than bincount: bincount on CUDA reads the largest id
    # back to the host to size its output.
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    padded_counts = (counts + (block_m - 1)) // block_m * block_m
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    padded_ends = torch.cumsum(padded_counts, 0, dtype=torch.int32)

    order = torch.argsort(flat, stable=True)  # pair ids grouped by expert
    sorted_ids = flat.index_select(0, order)
    # The i-th pair in expert order is its expert's (i - start)-th, and goes to that
    # offset in the expert's padded run.
    rank = torch.arange(num_pairs, device=device, dtype=torch.int32) - (ends - counts).index_select(0, sorted_ids)
    slots = (padded_ends - padded_counts).index_select(0, sorted_ids) + rank
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, slots.long(), order.to(torch.int32))

    # A block's expert: the first whose padded run ends after the block's first slot
    # (side="right" steps over experts with empty runs); none past the padded total.
    block_starts = torch.arange(0, capacity, block_m, device=device, dtype=torch.int32)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).to(torch.int32)
    block_experts = torch.where(block_experts < num_experts, block_experts, EXIT_EXPERT)
    num_padded = padded_ends[-1:].clone()
    return sorted_pairs, block_experts, num_padded


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # the GEMM's input: x [T, K] (first GEMM) or the activations [T*k, K]
    w_ptr,  # dense [E, N, K] weights, or the stacked QuantWeight's codes [E*N, ...]
    scales_ptr,  # QuantWeight only, as in quant_linear's kernel
    offsets_ptr,  # zeros (HAS_ZEROS) or mins
    super_scales_ptr,
    super_mins_ptr,
    codebook_ptr,  # QuantWeight with a codebook only
    perms_ptr,  # HAS_PERMS: [E, K] act-order of each expert
    gates_ptr,  # MUL_GATES: [T*k] fp32, each pair's gate
    sorted_pairs_ptr,
    block_experts_ptr,
    out_ptr,  # [T*k, N], rows in pair order
    N,
    K,
    num_pairs,  # T*k, also the sentinel
    stride_am,
    stride_ak,
    stride_we,  # dense: expert stride; quantized: unused
    stride_wn,  # dense: row stride; quantized: the codes' row stride
    stride_wk,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_ssn,
    stride_ssg,
    stride_smn,
    stride_smg,
    stride_pe,
    stride_pk,
    stride_om,
    stride_on,
    A_ROWS_PER_PAIR: tl.constexpr,  # top_k when the input is x, 1 when it is per pair
    QUANTIZED: tl.constexpr,
    HAS_PERMS: tl.constexpr,
    MUL_GATES: tl.constexpr,
    EVEN_K: tl.constexpr,  # BLOCK_K divides K (always so when QUANTIZED)
    PACKED: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_CODEBOOK: tl.constexpr,
    HAS_SUPER: tl.constexpr,
    GROUPS_PER_SUPER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Blocks vary fastest (axis 0, the only axis not capped at 65535): the blocks of one
    # expert are consecutive, so they run together and share its weight tiles in L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)

    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        # Past the padded total: the grid was sized for the worst case on the host.
        return
    expert64 = expert.to(tl.int64)

    # Sentinel slots (num_pairs) load zero rows and store nothing.
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair_mask = pairs < num_pairs
    a_rows = a_ptr + (pairs // A_ROWS_PER_PAIR)[:, None] * stride_am

    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    # 64-bit weight offsets: a stack of experts easily exceeds 2**31 elements.
    cols64 = cols.to(tl.int64)
    if QUANTIZED:
        # Expert e's rows of the stacked QuantWeight are e * N .. e * N + N - 1.
        w_rows = (expert64 * N + cols64)[None, :]
        codes_cols = w_ptr + w_rows * stride_wn
        scales_cols = scales_ptr + w_rows * stride_sn
        offsets_cols = offsets_ptr + w_rows * stride_zn
        super_scales_cols = super_scales_ptr + w_rows * stride_ssn
        super_mins_cols = super_mins_ptr + w_rows * stride_smn
    else:
        w_cols = w_ptr + expert64 * stride_we + cols64[None, :] * stride_wn
    if HAS_PERMS:
        perm_row = perms_ptr + expert64 * stride_pe

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a_mask = pair_mask[:, None]
        else:
            a_mask = pair_mask[:, None] & (ks[None, :] < K)
        # Act-order: expert e computes x[:, perms[e]] @ W_e.T, so its k-th stored input
        # column multiplies the input's column perms[e, k]. The permutation differs per
        # expert, so it is gathered here rather than applied to x once on the host.
        if HAS_PERMS:
            a_cols = tl.load(perm_row + ks * stride_pk)
        else:
            a_cols = ks
        a = tl.load(a_rows + a_cols[None, :] * stride_ak, mask=a_mask, other=0.0)

        if QUANTIZED:
            w = _dequantize_tile(
                codes_cols, scales_cols, offsets_cols, super_scales_cols, super_mins_cols, codebook_ptr, col_mask,
                k0, stride_wk, stride_sg, stride_zg, stride_ssg, stride_smg,
                PACKED, GROUP_SIZE, HAS_ZEROS, HAS_CODEBOOK, HAS_SUPER, GROUPS_PER_SUPER, BLOCK_K,
            )
        else:
            if EVEN_K:
                w_mask = col_mask[None, :]
            else:
                w_mask = (ks[:, None] < K) & col_mask[None, :]
            w = tl.load(w_cols + ks[:, None] * stride_wk, mask=w_mask, other=0.0)

        # As quant_linear: fp32 accumulation, "ieee" so fp32 inputs avoid TF32; the
        # weight is rounded once to the input's dtype, as the reference's F.linear sees it.
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision="ieee")

    if MUL_GATES:
        gate = tl.load(gates_ptr + pairs, mask=pair_mask, other=0.0)
        acc = acc * gate[:, None]

    out_ptrs = out_ptr + pairs[:, None] * stride_om + cols64[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=pair_mask[:, None] & col_mask[None, :])


def _weight_supported(weights: ExpertWeights) -> bool:
    if isinstance(weights.weight, QuantWeight):
        return _quant_supports(weights.weight)
    return weights.weight.dtype in _DENSE_DTYPES


def supports(experts: ExpertMLP) -> bool:
    """Whether the kernel handles every projection: dense fp32/fp16/bf16 experts, or
    QuantWeights ``quant_linear_triton`` handles (groups of a multiple of 16 inputs,
    codes of at most 8 bits)."""
    return all(_weight_supported(p) for p in (*experts.gate_up, experts.down))


def _choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block, from the pairs an expert gets on average: 16 when decoding (a
    block mostly padding costs a full tile), up to 64 for large prefills (each weight
    tile then serves more rows)."""
    per_expert = triton.cdiv(max(num_pairs, 1), max(num_experts, 1))
    return max(_MIN_DOT_DIM, min(_MAX_BLOCK_M, triton.next_power_of_2(per_expert)))


def _choose_block_k(weights: ExpertWeights) -> int:
    weight = weights.weight
    if isinstance(weight, QuantWeight):
        return _choose_quant_block_k(weight.group_size, weight.in_features)
    # Dense: the largest power of two up to 64 dividing K, so the K edge needs no mask
    # when K is a multiple of 16 (always, in practice); else 16 with a masked edge.
    return max(_MIN_DOT_DIM, min(_MAX_BLOCK_K, _largest_pow2_divisor(weights.in_features)))


def fused_moe(x: torch.Tensor, experts: ExpertMLP, gates: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``sum_j gates[t, j] * expert_{ids[t, j]}(x[t])`` for ``x [T, H]``; ``[T, H]`` in
    ``x``'s dtype."""
    block_m = _choose_block_m(ids.numel(), experts.num_experts)
    return _fused_moe(x, experts, gates, ids, block_m=block_m, block_n=_BLOCK_N, block_k=None)


def _fused_moe(
    x: torch.Tensor,
    experts: ExpertMLP,
    gates: torch.Tensor,
    ids: torch.Tensor,
    *,
    block_m: int,
    block_n: int,
    block_k: int | None,
) -> torch.Tensor:
    """``fused_moe`` with explicit tile sizes (powers of two, >= 16; ``block_k`` None
    chooses per projection), so tests can force many small tiles."""
    if not supports(experts):
        raise ValueError("expert weights the Triton MoE kernel does not support")
    if x.dim() != 2 or x.shape[1] != experts.down.out_features:
        raise ValueError(f"x must be [T, {experts.down.out_features}], got {tuple(x.shape)}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or gates.shape != ids.shape:
        raise ValueError(f"ids and gates must be [{x.shape[0]}, k], got {tuple(ids.shape)}, {tuple(gates.shape)}")
    for name, size in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k or _MIN_DOT_DIM)):
        if size < _MIN_DOT_DIM or size & (size - 1):
            raise ValueError(f"{name}={size} is not a power of two >= {_MIN_DOT_DIM}")

    if sum(p.out_features for p in experts.gate_up) != 2 * experts.intermediate_size:
        raise ValueError(f"gate_up does not have 2 * {experts.intermediate_size} outputs")

    num_tokens, top_k = ids.shape
    hidden = x.shape[1]
    intermediate = experts.intermediate_size
    if num_tokens == 0:
        return x.new_empty(0, hidden)
    num_pairs = num_tokens * top_k
    sorted_pairs, block_experts, _ = align_by_expert(ids, experts.num_experts, block_m)

    # GEMM 1: every gate_up part into its columns of one [T*k, 2I] buffer.
    h = torch.empty(num_pairs, 2 * intermediate, dtype=x.dtype, device=x.device)
    start = 0
    for part in experts.gate_up:
        stop = start + part.out_features
        _grouped_gemm(x, part, h[:, start:stop], sorted_pairs, block_experts, None, top_k,
                      block_m=block_m, block_n=block_n, block_k=block_k)
        start = stop
    act = experts.activate(h, ids.reshape(-1))  # [T*k, I], contiguous; pair p's expert is ids.flat[p]

    # GEMM 2: down, each row scaled by its pair's gate (in the fp32 accumulator), in
    # pair order so that each token's k rows are adjacent for the sum. Stored in x's
    # dtype, as the reference rounds each expert's output too; fp32 would double a buffer
    # of T*k*H elements (4096 tokens, top-8, H 2048: 128 MiB in fp16, 256 MiB in fp32).
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    pair_gates = gates.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(act, experts.down, y, sorted_pairs, block_experts, pair_gates, 1,
                  block_m=block_m, block_n=block_n, block_k=block_k)
    out = y.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32)
    if experts.down_bias is not None:  # the kernel weighted each pair's output: add the weighted biases
        out += experts.down_bias_sum(gates, ids)
    return out.to(x.dtype)


def _grouped_gemm(
    a: torch.Tensor,
    weights: ExpertWeights,
    out: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_experts: torch.Tensor,
    pair_gates: torch.Tensor | None,
    rows_per_pair: int,
    *,
    block_m: int,
    block_n: int,
    block_k: int | None,
) -> None:
    """``out[p] = (gate[p] *) a[p // rows_per_pair] @ W_e.T`` for every pair ``p`` of
    expert ``e``, in one launch over the blocks of ``align_by_expert``."""
    k = weights.in_features
    if a.shape[1] != k:
        raise ValueError(f"input has {a.shape[1]} features, the experts {k} inputs")
    weight = weights.weight
    block_k = block_k or _choose_block_k(weights)
    if isinstance(weight, QuantWeight) and (k % block_k or (weight.group_size % block_k and block_k % weight.group_size)):
        raise ValueError(f"block_k={block_k} does not tile K={k} in groups of {weight.group_size}")
    if isinstance(weight, QuantWeight):
        quant = (weight.scales, weight.zeros, weight.mins, weight.super_scales, weight.super_mins, weight.codebook)
        packed, group_size, groups_per_super = weight.packed, weight.group_size, weight.groups_per_super
    else:
        quant, packed, group_size, groups_per_super = (None,) * 6, False, 1, 1
    torch.ops.localserve.moe_gemm(a, weight if isinstance(weight, torch.Tensor) else weight.codes, *quant,
                                  weights.perms, pair_gates, sorted_pairs, block_experts, out, rows_per_pair,
                                  packed, group_size, groups_per_super, block_m, block_n, block_k)


@torch.library.custom_op("localserve::moe_gemm", mutates_args=("out",))
def _moe_gemm_op(a: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, zeros: torch.Tensor | None,
                 mins: torch.Tensor | None, super_scales: torch.Tensor | None, super_mins: torch.Tensor | None,
                 codebook: torch.Tensor | None, perms: torch.Tensor | None, pair_gates: torch.Tensor | None, sorted_pairs: torch.Tensor,
                 block_experts: torch.Tensor, out: torch.Tensor, rows_per_pair: int, packed: bool, group_size: int,
                 groups_per_super: int, block_m: int, block_n: int, block_k: int) -> None:
    """The grouped GEMM's launch. ``weight`` is the dense ``[E, N, K]`` experts, or the
    codes of a stacked QuantWeight whose other fields follow (``scales`` None: dense)."""
    quantized = scales is not None
    n, k = out.shape[1], a.shape[1]
    if scales is not None:
        has_super = super_scales is not None
        offsets, super_scales, super_mins, codebook_values = quant_operands(scales, zeros, mins, super_scales,
                                                                            super_mins, codebook)
        w_strides = (0, *weight.stride())
        quant_tensors = (scales, offsets, super_scales, super_mins, codebook_values)
        quant_strides = (*scales.stride(), *offsets.stride(), *super_scales.stride(), *super_mins.stride())
    else:
        # Never read for dense weights: pass the weight itself and zero strides.
        has_super = False
        w_strides = weight.stride()
        quant_tensors = (weight,) * 5
        quant_strides = (0,) * 8

    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a,
        weight,
        *quant_tensors,
        perms if perms is not None else sorted_pairs,  # never read without HAS_PERMS
        pair_gates if pair_gates is not None else out,  # never read without MUL_GATES
        sorted_pairs,
        block_experts,
        out,
        n,
        k,
        out.shape[0],
        *a.stride(),
        *w_strides,
        *quant_strides,
        *(perms.stride() if perms is not None else (0, 0)),
        *out.stride(),
        A_ROWS_PER_PAIR=rows_per_pair,
        QUANTIZED=quantized,
        HAS_PERMS=perms is not None,
        MUL_GATES=pair_gates is not None,
        EVEN_K=k % block_k == 0,
        PACKED=packed,
        GROUP_SIZE=group_size,
        HAS_ZEROS=zeros is not None if quantized else True,
        HAS_CODEBOOK=codebook is not None,
        HAS_SUPER=has_super,
        GROUPS_PER_SUPER=groups_per_super,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=NUM_WARPS,
    )


@_moe_gemm_op.register_fake
def _(a, weight, scales, zeros, mins, super_scales, super_mins, codebook, perms, pair_gates,  # type: ignore[no-untyped-def]
      sorted_pairs, block_experts, out, rows_per_pair, packed, group_size, groups_per_super, block_m, block_n,
      block_k) -> None:
    return None  # it only writes ``out``
