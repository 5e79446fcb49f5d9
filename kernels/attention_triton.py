"""Triton kernels for the paged KV cache: writing new keys/values and causal attention.

See ``attention.py`` for the cache layout and ``AttentionMetadata``; ``attention_ref.py``
is the definition of correct. Both kernels use only plain ``tl.load``/``tl.store``/
``tl.dot`` so they run on any Triton 3.x GPU backend and under ``TRITON_INTERPRET=1``.

Each launch is a torch custom op (``localserve::write_kv``, ``localserve::paged_attention``)
with a fake implementation, so the CUDA step can be traced under FakeTensorMode (shapes,
dtypes and devices without a GPU) and captured in CUDA graphs; the checks on shapes run
in the Python wrappers, before the op, in both modes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_kv import KV_QMAX, MIN_KV_SCALE, AttentionMetadata

# exp(x) == exp2(x * log2(e)); folding log2(e) into the softmax scale lets the inner
# loop use exp2, which maps to a single hardware instruction.
_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)

# tl.dot requires every dimension to be at least 16.
_MIN_DOT_DIM = 16


# --------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_sb,
    stride_ss,
    stride_sh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    QMAX: tl.constexpr,  # 0: the cache holds the values; else an 8-bit cache's largest code
    ROUND: tl.constexpr,  # int8 codes round to integers, float8 codes to the e4m3 grid
    MIN_SCALE: tl.constexpr,
):
    # One program per token, copying all of its kv heads at once: a token's heads are
    # contiguous in both source and cache, so this is one wide coalesced copy.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        # Padding tokens (slot -1) own no cache space.
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)

    # Padded lanes load 0, so they never raise a head's absolute maximum when quantizing.
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask, other=0.0)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask, other=0.0)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims * stride_kcd
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims * stride_vcd
    if QMAX > 0:
        scale_offset = block * stride_sb + offset * stride_ss + heads * stride_sh
        k = _quantize(k, k_scale_ptr + scale_offset, heads < NUM_KV_HEADS, QMAX, ROUND, MIN_SCALE)
        v = _quantize(v, v_scale_ptr + scale_offset, heads < NUM_KV_HEADS, QMAX, ROUND, MIN_SCALE)
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize(x, scale_ptrs, head_valid, QMAX: tl.constexpr, ROUND: tl.constexpr, MIN_SCALE: tl.constexpr):
    """Rows of ``x`` (one per head) as codes in fp32, storing each row's scale;
    the same arithmetic as ``attention_ref.quantize_kv``."""
    x = x.to(tl.float32)
    # The reference's product by the reciprocal (exact in fp32 on any device), and div_rn for
    # the codes: a GPU's fp32 "/" is approximate (div.full.f32, up to 2 ulp), which moves a
    # code next to a rounding tie away from the reference's; the interpreter's is exact.
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) * (1.0 / QMAX), MIN_SCALE)
    tl.store(scale_ptrs, scale[:, None], mask=head_valid)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -QMAX), QMAX)
    if ROUND:
        return _round_half_even(y)
    return _round_to_e4m3(y)


@triton.jit
def _round_half_even(x):
    # For |x| < 2**22: x + 1.5 * 2**23 has no fraction bits left, so the fp32 add
    # itself rounds x to an integer, ties to even; subtracting gives it back exactly.
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _round_to_e4m3(y):
    """``y`` (fp32, |y| <= 448) rounded to the nearest float8 e4m3 value, ties to even,
    exactly in fp32, so the cast that follows has nothing left to round. Casts alone
    are not trusted: the interpreter's drops the carry (127.9 gives 64) and some GPUs
    round twice, through fp16."""
    biased_exponent = (y.to(tl.int32, bitcast=True) >> 23) & 0xFF
    # 3 mantissa bits: a step of 2**(exponent - 3); below 2**-6, subnormal steps of 2**-9.
    step = ((tl.maximum(biased_exponent, 127 - 6) - 3) << 23).to(tl.float32, bitcast=True)
    return _round_half_even(y / step) * step


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at their cache
    slots, cast to the cache dtype, or quantized when scales are given. Tokens whose
    slot is negative are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    _check_scales(k_cache, k_scale, v_scale)
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping shape {tuple(slot_mapping.shape)} != ({num_tokens},)")
    if num_tokens == 0:
        return
    torch.ops.localserve.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@torch.library.custom_op("localserve::write_kv", mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))
def _write_kv_op(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    scales = _check_scales(k_cache, k_scale, v_scale)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        scales[0],
        scales[1],
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *scales[0].stride()[:3],  # placeholders pass the cache's first three
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        QMAX=_qmax(k_scale, k_cache),
        ROUND=k_cache.dtype == torch.int8,
        MIN_SCALE=MIN_KV_SCALE,
    )


@_write_kv_op.register_fake
def _(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:  # type: ignore[no-untyped-def]
    return None  # it only writes the cache


# --------------------------------------------------------------------------------------
# paged_attention
# --------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["window"])  # one program for every window size
def _paged_attention_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sinks_ptr,  # one logit per query head (HAS_SINKS); else a placeholder never read
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    score_scale,  # q.k times this: scale * log2(e); with SOFTCAP, scale / softcap
    softcap_log2,  # with SOFTCAP: softcap * log2(e), what tanh's output is scaled by
    window,  # sliding window in tokens; 0: none
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_btb,
    stride_btn,
    QUANTIZED: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr,  # a program of its own: the branch costs registers in every other
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Each program owns one sequence, one kv head and a tile of that sequence's new
    # tokens. The GROUP query heads sharing the kv head are packed into the rows of
    # the tile (row = token * GROUP + head-in-group), so a decode token under GQA still
    # fills a tl.dot tile and every loaded key/value is reused by the whole group.
    # Tiles vary fastest so programs reading the same sequence's keys run together
    # (L2 reuse); axis 0 is also the only one not capped at 65535 for long prompts.
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    TOKENS_PER_TILE: tl.constexpr = BLOCK_M // GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_token = tile * TOKENS_PER_TILE
    # The grid is sized for the longest query in the batch; shorter ones have spare tiles.
    if first_token >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    token = first_token + rows // GROUP  # index within this sequence's new tokens
    head = kv_head * GROUP + rows % GROUP
    # When GROUP does not divide BLOCK_M the last partial group of rows is unused.
    row_valid = (rows < TOKENS_PER_TILE * GROUP) & (token < query_len)
    q_pos = context_len + token  # absolute position, the causal limit of the row

    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM

    q_row = (q_start + token).to(tl.int64)
    q_ptrs = query_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # Finite initial max: rows with no visible key in a tile then give exp2(-inf) = 0
    # rather than exp2(-inf - -inf) = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        # The sink is the softmax's first column: the running max starts at it and the
        # running sum at its weight, exp2(sink - max) = 1; it adds nothing to acc.
        m_i = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * _LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)

    # Keys past the last token of this tile are causally invisible to every row, and
    # under a sliding window so are those before the first row's window.
    last_token = tl.minimum(first_token + TOKENS_PER_TILE, query_len) - 1
    kv_end = context_len + last_token + 1
    kv_begin = 0
    if window > 0:
        kv_begin = tl.maximum(context_len + first_token - window + 1, 0)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_btb
    cols = tl.arange(0, BLOCK_N)
    for kv_start in range(kv_begin, kv_end, BLOCK_N):
        kv_pos = kv_start + cols
        kv_valid = kv_pos < kv_end
        # Look the block up per key, so BLOCK_N need not equal the cache block size;
        # masked keys never touch the (padded, possibly garbage) block-table tail.
        block = tl.load(block_table + (kv_pos // BLOCK_SIZE) * stride_btn, mask=kv_valid, other=0)
        block = block.to(tl.int64)  # block * stride can overflow int32 in a large cache
        offset = kv_pos % BLOCK_SIZE
        kv_mask = kv_valid[:, None] & dim_valid[None, :]

        k_ptrs = (
            k_cache_ptr
            + block[:, None] * stride_kcb
            + offset[:, None] * stride_kcs
            + kv_head * stride_kch
            + dims[None, :] * stride_kcd
        )
        # The reference casts (or dequantizes) the cache to the query dtype before the
        # matmul; match it.
        if QUANTIZED:
            scale_offsets = block * stride_sb + offset * stride_ss + kv_head * stride_sh
            k = _load_dequantized(k_ptrs, k_scale_ptr + scale_offsets, kv_mask, kv_valid)
        else:
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        k = k.to(q.dtype)
        # "ieee" only matters for fp32 inputs, which would otherwise go through TF32
        # (~1e-3 error); fp16/bf16 use tensor cores either way.
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        if SOFTCAP:  # softcap * tanh(scale * q.k / softcap), in log2 units
            s = _tanh(s * score_scale) * softcap_log2
        else:
            s = s * score_scale
        visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_valid[None, :]
        if window > 0:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_ptrs = (
            v_cache_ptr
            + block[:, None] * stride_vcb
            + offset[:, None] * stride_vcs
            + kv_head * stride_vch
            + dims[None, :] * stride_vcd
        )
        if QUANTIZED:
            v = _load_dequantized(v_ptrs, v_scale_ptr + scale_offsets, kv_mask, kv_valid)
        else:
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # Every valid row sees at least key 0, so l_i > 0 there; guard only the unused rows.
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit
def _tanh(x):
    """tanh from one exp2, as sign(x) * (1 - e^-2|x|) / (1 + e^-2|x|): no overflow at
    any |x|, and portable (Triton has no tanh of its own on every backend)."""
    t = tl.math.exp2(tl.abs(x) * (-2.0 * _LOG2E))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _load_dequantized(code_ptrs, scale_ptrs, mask, row_valid):
    """A tile of 8-bit codes times their per-row scales, in fp32, 0 where masked."""
    # No fill value on the code load: the interpreter cannot cast one to float8.
    codes = tl.load(code_ptrs, mask=mask).to(tl.float32)
    scales = tl.load(scale_ptrs, mask=row_valid, other=0.0)
    return tl.where(mask, codes * scales[:, None], 0.0)


def _choose_tiles(max_query_len: int, group: int, head_dim: int, quantized: bool = False) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) heuristics: small tiles for decode, larger for prefill, and
    smaller for wide heads to keep the fp32 accumulator within registers. An 8-bit
    cache's tiles are dequantized to fp32 in registers too, so with wide heads they are
    smaller again, as are the key tiles of heads over 128 (Gemma's 256; with the sliding
    window's and the soft cap's code, 32 keys spill on sm_90): the sizes below are the
    largest that do not spill on sm_80 to sm_90 at 8 warps (scripts/triton_aot.py)."""
    dim_pad = triton.next_power_of_2(head_dim)
    group_pad = triton.next_power_of_2(group)
    wide = dim_pad > 64
    if max_query_len <= 1:
        # Pure decode: one token per sequence, so a tile only needs the head group.
        block_m = group_pad
    elif quantized and wide:
        block_m = 32 if dim_pad <= 128 else 16
    else:
        block_m = 64 if dim_pad <= 128 else 32
    block_n = 16 if (quantized and wide) or dim_pad > 128 else 32 if wide else 64
    return max(block_m, group_pad, _MIN_DOT_DIM), max(block_n, _MIN_DOT_DIM)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``query [num_tokens, num_heads, head_dim]`` over the paged
    cache (8-bit when scales are given), for a flat batch of prefill chunks and decode
    tokens; a token at position p sees only keys above ``p - window`` when a sliding
    window is given; ``softcap`` and ``sinks`` as ``attention.paged_attention`` says.
    Returns a tensor of the query's shape and dtype."""
    block_m, block_n = _choose_tiles(meta.max_query_len, _group_size(query, k_cache), query.shape[2],
                                     quantized=k_scale is not None)
    return _paged_attention(query, k_cache, v_cache, meta, scale, k_scale, v_scale, window, softcap, sinks,
                            block_m=block_m, block_n=block_n)


def _group_size(query: torch.Tensor, k_cache: torch.Tensor) -> int:
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return num_heads // num_kv_heads


def _paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    *,
    block_m: int,
    block_n: int,
) -> torch.Tensor:
    """``paged_attention`` with explicit tile sizes (powers of two, >= 16), so tests can
    force many small tiles."""
    num_tokens, _, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = _group_size(query, k_cache)
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    _check_scales(k_cache, k_scale, v_scale)
    if block_m < max(group, _MIN_DOT_DIM) or block_n < _MIN_DOT_DIM:
        raise ValueError(f"tiles too small: block_m={block_m}, block_n={block_n}, group={group}")

    if num_tokens == 0 or meta.seq_lens.shape[0] == 0:
        return torch.empty_like(query)
    return torch.ops.localserve.paged_attention(query, k_cache, v_cache, k_scale, v_scale, meta.block_tables,
                                                meta.query_start_loc, meta.seq_lens, meta.max_query_len, scale,
                                                window or 0, softcap, sinks, block_m, block_n)


@torch.library.custom_op("localserve::paged_attention", mutates_args=())
def _paged_attention_op(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, block_tables: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, scale: float,
                        window: int, softcap: float, sinks: torch.Tensor | None, block_m: int,
                        block_n: int) -> torch.Tensor:
    head_dim = query.shape[2]
    group = _group_size(query, k_cache)
    scales = _check_scales(k_cache, k_scale, v_scale)
    out = torch.empty_like(query)
    grid = (triton.cdiv(max_query_len, block_m // group), seq_lens.shape[0], k_cache.shape[2])
    _paged_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        scales[0],
        scales[1],
        query if sinks is None else sinks,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        scale / softcap if softcap > 0 else scale * _LOG2E.value,
        softcap * _LOG2E.value,
        window,
        *query.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *scales[0].stride()[:3],  # placeholders pass the cache's first three
        *block_tables.stride(),
        QUANTIZED=k_scale is not None,
        HAS_SINKS=sinks is not None,
        SOFTCAP=softcap > 0,
        GROUP=group,
        HEAD_DIM=head_dim,
        # Heads narrower than 16 (the built-in demo's are 8) still fill a tl.dot operand.
        DIM_PAD=max(triton.next_power_of_2(head_dim), _MIN_DOT_DIM),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=8,  # with 4, most tiles spill registers on sm_80 to sm_90 (scripts/triton_aot.py)
    )
    return out


@_paged_attention_op.register_fake
def _(query, k_cache, v_cache, k_scale, v_scale, block_tables, query_start_loc, seq_lens,  # type: ignore[no-untyped-def]
      max_query_len, scale, window, softcap, sinks, block_m, block_n) -> torch.Tensor:
    return torch.empty_like(query)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache shape {tuple(k_cache.shape)} != v_cache shape {tuple(v_cache.shape)}")
    if k_cache.dim() != 4 or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"cache shape {tuple(k_cache.shape)} does not match "
            f"[num_blocks, block_size, {num_kv_heads}, {head_dim}]"
        )
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} is not a power of two")


def _check_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale tensors to pass the kernels: the real ones for an 8-bit cache, else
    the caches themselves as placeholders the kernels never read."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale are given together or not at all")
    if k_scale is None or v_scale is None:
        if k_cache.dtype in KV_QMAX:
            raise ValueError(f"a {k_cache.dtype} cache needs scales")
        return k_cache, k_cache
    if k_cache.dtype not in KV_QMAX:
        raise ValueError(f"scales given for a {k_cache.dtype} cache; 8-bit caches are {sorted(map(str, KV_QMAX))}")
    expected = k_cache.shape[:3]
    for scales in (k_scale, v_scale):
        if scales.shape != expected or scales.dtype != torch.float32:
            raise ValueError(f"scales {tuple(scales.shape)} {scales.dtype} != {tuple(expected)} float32")
    if k_scale.stride() != v_scale.stride():
        raise ValueError("k_scale and v_scale must have the same strides")
    return k_scale, v_scale


def _qmax(scales: torch.Tensor | None, cache: torch.Tensor) -> float:
    return 0.0 if scales is None else KV_QMAX[cache.dtype]
