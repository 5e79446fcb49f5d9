"""Triton dequantize-GEMM for ``QuantWeight``: ``x @ W.T (+ bias)`` without ever
materialising the dense weight.

See ``quant_linear.py`` for the layout; its ``quant_linear_ref`` is the definition of
correct. Each program computes one ``BLOCK_M x BLOCK_N`` tile of the output (rows of
``x`` by output features), walking the inputs in ``BLOCK_K`` steps: it loads the uint8
codes of a ``BLOCK_K x BLOCK_N`` slice of ``W.T``, unpacks nibbles if needed,
dequantizes them in fp32 with the slice's per-group scales and zeros (or mins), or
looks each code up in the weight's codebook (GGUF's IQ types, MXFP4) and scales it, casts
to ``x``'s dtype and accumulates ``tl.dot`` in fp32. The dequantization of a tile is one
``@triton.jit`` function, ``_dequantize_tile``, which the grouped MoE GEMM
(``moe_triton.py``) calls too, so the layout is decoded in one place.

Act-order (``weight.perm``) is applied to ``x`` on the host with one ``index_select``
before the launch: ``x`` is small next to the weight (a handful of rows when decoding),
and a contiguous ``x`` keeps the kernel's loads plain and coalesced.

Only plain ``tl.load``/``tl.store``/``tl.dot`` are used, so the kernel runs on any
Triton 3.x GPU backend and under ``TRITON_INTERPRET=1``. The launch is the torch custom
op ``localserve::quant_linear``, with a fake implementation (see attention_triton.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .quant_weight import QuantWeight

# tl.dot requires every dimension to be at least 16; group sizes are multiples of it.
_MIN_DOT_DIM = 16
_MAX_BLOCK_K = 64
# Warps per program. Each tile's dequantized codes and fp32 accumulator are spread over
# the warps' registers; with 4, every K-quant tile of 64 rows and some decode tiles spill
# on sm_80 to sm_90 (scripts/triton_aot.py), with 8 none does.
NUM_WARPS = 8


@triton.jit
def _dequantize_tile(
    codes_cols,  # [1, BLOCK_N] pointers: each output column's row of codes
    scales_cols,  # likewise into scales, zeros-or-mins, super_scales, super_mins
    offsets_cols,
    super_scales_cols,
    super_mins_cols,
    codebook_ptr,  # HAS_CODEBOOK: fp32 [2 ** bits], each code's value
    col_mask,  # [BLOCK_N]: columns past N load weight 0 (code, scale and offset 0)
    k0,  # the tile's first input; a multiple of BLOCK_K
    stride_ck,
    stride_sg,
    stride_zg,
    stride_ssg,
    stride_smg,
    PACKED: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_CODEBOOK: tl.constexpr,
    HAS_SUPER: tl.constexpr,
    GROUPS_PER_SUPER: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The fp32 ``[BLOCK_K, BLOCK_N]`` tile ``W.T[k0:k0 + BLOCK_K, cols]`` of a
    QuantWeight, dequantized with the same fp32 operations as ``dequantize``.

    Shared by every kernel that multiplies by a QuantWeight (``quant_linear`` and the
    grouped MoE GEMM): callers point ``*_cols`` at the weight rows they need (a stacked
    expert's rows start at ``e * N``), so the layout is decoded in one place. The caller
    guarantees that ``BLOCK_K`` divides the group size or is a multiple of it, and that
    the tile lies inside K (K is a multiple of the group size)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    mask = col_mask[None, :]
    # Codes of W.T[k, n] as a [BLOCK_K, BLOCK_N] tile.
    if PACKED:
        # Input 2j is the low nibble of byte j, 2j + 1 the high one. Each byte is
        # read for both of its inputs; the second read is served from cache.
        byte = tl.load(codes_cols + (ks[:, None] // 2) * stride_ck, mask=mask, other=0)
        q = (byte.to(tl.int32) >> ((ks[:, None] % 2) * 4)) & 0xF
    else:
        q = tl.load(codes_cols + ks[:, None] * stride_ck, mask=mask, other=0)
    if not HAS_CODEBOOK:
        q = q.to(tl.float32)

    # Group of each input: a scalar when the whole tile lies in one group (one
    # scale per output column), else per input (several whole groups per tile).
    # Either way the loads below broadcast against the [BLOCK_K, BLOCK_N] codes.
    if BLOCK_K <= GROUP_SIZE:
        g = k0 // GROUP_SIZE
    else:
        g = ks[:, None] // GROUP_SIZE
    scale = tl.load(scales_cols + g * stride_sg, mask=mask, other=0.0).to(tl.float32)
    if not HAS_CODEBOOK:
        offset = tl.load(offsets_cols + g * stride_zg, mask=mask, other=0).to(tl.float32)
    if HAS_SUPER:
        # Two-level scales: the same fp32 product the reference forms per group.
        sg = g // GROUPS_PER_SUPER
        scale = tl.load(super_scales_cols + sg * stride_ssg, mask=mask, other=0.0).to(tl.float32) * scale
        if not HAS_ZEROS and not HAS_CODEBOOK:
            offset = tl.load(super_mins_cols + sg * stride_smg, mask=mask, other=0.0).to(tl.float32) * offset
    # Dequantize in fp32 exactly as the reference does; the caller rounds once to x's dtype.
    if HAS_CODEBOOK:
        # A gather from a table of at most 16 floats, which stays in L1. Masked columns
        # look up code 0 under scale 0.
        w = scale * tl.load(codebook_ptr + q.to(tl.int32))
    elif HAS_ZEROS:
        w = scale * (q - offset)
    else:
        w = scale * q - offset
    return w


@triton.jit
def _quant_linear_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    zeros_ptr,  # zeros (HAS_ZEROS) or mins; same [N, groups] indexing
    super_scales_ptr,  # two-level scales (HAS_SUPER): [N, groups // GROUPS_PER_SUPER]
    super_mins_ptr,  # their mins counterpart (HAS_SUPER and not HAS_ZEROS)
    codebook_ptr,  # HAS_CODEBOOK: each code's value
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_cn,
    stride_ck,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_ssn,
    stride_ssg,
    stride_smn,
    stride_smg,
    stride_b,
    stride_om,
    stride_on,
    PACKED: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_CODEBOOK: tl.constexpr,
    HAS_SUPER: tl.constexpr,
    GROUPS_PER_SUPER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Row tiles vary fastest (axis 0, also the only axis not capped at 65535), so the
    # programs sharing one slice of the weight run together and reuse it from L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    row_mask = rows < M
    col_mask = cols < N
    # 64-bit row offsets: an lm_head's codes can approach 2**31 bytes.
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)

    x_rows = x_ptr + rows64[:, None] * stride_xm
    codes_cols = codes_ptr + cols64[None, :] * stride_cn
    scales_cols = scales_ptr + cols64[None, :] * stride_sn
    zeros_cols = zeros_ptr + cols64[None, :] * stride_zn
    super_scales_cols = super_scales_ptr + cols64[None, :] * stride_ssn
    super_mins_cols = super_mins_ptr + cols64[None, :] * stride_smn

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # The host guarantees K % BLOCK_K == 0 (K is a multiple of the group size, and
    # BLOCK_K divides either K's group or K itself), so there is no K edge to mask.
    # Masked output columns load code 0, scale 0 and zero/min 0, i.e. weight 0.
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)

        x = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_mask[:, None], other=0.0)
        w = _dequantize_tile(
            codes_cols, scales_cols, zeros_cols, super_scales_cols, super_mins_cols, codebook_ptr, col_mask, k0,
            stride_ck, stride_sg, stride_zg, stride_ssg, stride_smg,
            PACKED, GROUP_SIZE, HAS_ZEROS, HAS_CODEBOOK, HAS_SUPER, GROUPS_PER_SUPER, BLOCK_K,
        )

        # "ieee" only matters for fp32 inputs, which would otherwise go through TF32
        # (~1e-3 error); fp16/bf16 use tensor cores either way.
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision="ieee")

    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols64 * stride_b, mask=col_mask, other=0.0).to(tl.float32)
        acc += bias[None, :]

    out_ptrs = out_ptr + rows64[:, None] * stride_om + cols64[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def supports(weight: QuantWeight) -> bool:
    """Whether the kernel handles this weight's layout: groups of a multiple of 16 inputs
    (every format localserve loads) and codes of at most 8 bits."""
    return weight.group_size % _MIN_DOT_DIM == 0 and weight.group_size > 0 and weight.bits <= 8


def _largest_pow2_divisor(n: int) -> int:
    return n & -n


def _choose_block_k(group_size: int, in_features: int) -> int:
    """A power of two >= 16 dividing ``in_features`` that either divides the group size
    (one group per tile) or is a multiple of it (whole groups per tile)."""
    if group_size < _MAX_BLOCK_K and group_size & (group_size - 1) == 0:
        # Small power-of-two groups (GGUF's 16 and 32): several groups per tile.
        return min(_MAX_BLOCK_K, _largest_pow2_divisor(in_features))
    # Large or non-power-of-two groups (48, or one group over all of K): tile within one.
    return min(_MAX_BLOCK_K, _largest_pow2_divisor(group_size))


def _choose_tiles(m: int, group_size: int, in_features: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): a 16-row tile for decode, up to 64 rows for prefill.
    A decode tile takes at most 32 inputs a step: with 64, Q4_0's spills registers on
    sm_90 (scripts/triton_aot.py). Half of a valid BLOCK_K of 64 still tiles K in whole
    groups or within one."""
    block_m = max(_MIN_DOT_DIM, min(64, triton.next_power_of_2(max(m, 1))))
    block_k = _choose_block_k(group_size, in_features)
    return block_m, 64, min(block_k, 32) if block_m <= _MIN_DOT_DIM else block_k


def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x[..., perm] @ dequantize(weight).T + bias`` for ``x [..., in_features]``;
    returns ``[..., out_features]`` in ``x``'s dtype."""
    m = math.prod(x.shape[:-1])
    block_m, block_n, block_k = _choose_tiles(m, weight.group_size, weight.in_features)
    return _quant_linear(x, weight, bias, block_m=block_m, block_n=block_n, block_k=block_k)


def _quant_linear(
    x: torch.Tensor,
    weight: QuantWeight,
    bias: torch.Tensor | None,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
) -> torch.Tensor:
    """``quant_linear`` with explicit tile sizes (powers of two, >= 16), so tests can
    force many small tiles and both group/tile arrangements."""
    n, k = weight.shape
    if not supports(weight):
        raise ValueError(f"unsupported QuantWeight: bits={weight.bits}, group_size={weight.group_size}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k} inputs")
    if k % weight.group_size:
        raise ValueError(f"group size {weight.group_size} does not divide {k} inputs")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias shape {tuple(bias.shape)} != ({n},)")
    for name, size in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if size < _MIN_DOT_DIM or size & (size - 1):
            raise ValueError(f"{name}={size} is not a power of two >= {_MIN_DOT_DIM}")
    if k % block_k or (weight.group_size % block_k and block_k % weight.group_size):
        raise ValueError(f"block_k={block_k} does not tile K={k} in groups of {weight.group_size}")

    lead = x.shape[:-1]
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm)
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0 or n == 0:
        return x.new_empty(*lead, n)

    out = torch.ops.localserve.quant_linear(x2, weight.codes, weight.scales, weight.zeros, weight.mins,
                                            weight.super_scales, weight.super_mins, weight.codebook, bias,
                                            weight.packed,
                                            weight.group_size, weight.groups_per_super, block_m, block_n, block_k)
    return out.view(*lead, n)


@torch.library.custom_op("localserve::quant_linear", mutates_args=())
def _quant_linear_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     mins: torch.Tensor | None, super_scales: torch.Tensor | None, super_mins: torch.Tensor | None,
                     codebook: torch.Tensor | None, bias: torch.Tensor | None, packed: bool, group_size: int, groups_per_super: int, block_m: int,
                     block_n: int, block_k: int) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` for the QuantWeight of these fields."""
    m, k = x.shape
    n = codes.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    has_super = super_scales is not None
    offsets, super_scales, super_mins, codebook_values = quant_operands(scales, zeros, mins, super_scales,
                                                                        super_mins, codebook)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quant_linear_kernel[grid](
        x,
        codes,
        scales,
        offsets,
        super_scales,
        super_mins,
        codebook_values,
        bias if bias is not None else out,  # never read without HAS_BIAS
        out,
        m,
        n,
        k,
        *x.stride(),
        *codes.stride(),
        *scales.stride(),
        *offsets.stride(),
        *super_scales.stride(),
        *super_mins.stride(),
        bias.stride(0) if bias is not None else 0,
        *out.stride(),
        PACKED=packed,
        GROUP_SIZE=group_size,
        HAS_ZEROS=zeros is not None,
        HAS_CODEBOOK=codebook is not None,
        HAS_SUPER=has_super,
        GROUPS_PER_SUPER=groups_per_super,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=NUM_WARPS,
    )
    return out


def quant_operands(scales: torch.Tensor, zeros: torch.Tensor | None, mins: torch.Tensor | None,
                   super_scales: torch.Tensor | None, super_mins: torch.Tensor | None, codebook: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The offsets (zeros or mins), the two super-scale pointers and the codebook a kernel
    taking ``_dequantize_tile``'s layout is passed: a pointer its flags say is never read
    (offsets under a codebook, super scales without two levels) gets any tensor."""
    offsets = next(t for t in (zeros, mins, scales) if t is not None)
    super_scales = super_scales if super_scales is not None else scales
    super_mins = super_mins if super_mins is not None else super_scales
    return offsets, super_scales, super_mins, codebook if codebook is not None else scales


@_quant_linear_op.register_fake
def _(x, codes, scales, zeros, mins, super_scales, super_mins, codebook, bias,  # type: ignore[no-untyped-def]
      packed, group_size, groups_per_super, block_m, block_n, block_k) -> torch.Tensor:
    return x.new_empty(x.shape[0], codes.shape[0])
