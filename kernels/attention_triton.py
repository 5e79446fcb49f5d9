"""Triton kernels for the paged KV cache: writing new keys/values and causal attention.

See ``attention.py`` for the cache layout and ``AttentionMetadata``; ``attention_ref.py``
is the definition of correct. Both kernels use only plain ``tl.load``/``tl.store``/
``tl.dot`` so they run on any Triton 3.x GPU backend and under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from .attention import AttentionMetadata

# exp(x) == exp2(x * log2(e)); folding log2(e) into the softmax scale lets the inner
# loop use exp2, which maps to a single hardware instruction.
_LOG2E = 1.4426950408889634

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
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
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

    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims * stride_kcd
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims * stride_vcd
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at their cache
    slots, cast to the cache dtype. Tokens whose slot is negative are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping shape {tuple(slot_mapping.shape)} != ({num_tokens},)")
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )


# --------------------------------------------------------------------------------------
# paged_attention
# --------------------------------------------------------------------------------------


@triton.jit
def _paged_attention_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
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
    stride_btb,
    stride_btn,
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
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)

    # Keys past the last token of this tile are causally invisible to every row.
    last_token = tl.minimum(first_token + TOKENS_PER_TILE, query_len) - 1
    kv_end = context_len + last_token + 1
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_btb
    cols = tl.arange(0, BLOCK_N)
    for kv_start in range(0, kv_end, BLOCK_N):
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
        # The reference casts the cache to the query dtype before the matmul; match it.
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
        # "ieee" only matters for fp32 inputs, which would otherwise go through TF32
        # (~1e-3 error); fp16/bf16 use tensor cores either way.
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_valid[None, :]
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
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # Every valid row sees at least key 0, so l_i > 0 there; guard only the unused rows.
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


def _choose_tiles(max_query_len: int, group: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) heuristics: small tiles for decode, larger for prefill, and
    smaller for wide heads to keep the fp32 accumulator within registers."""
    dim_pad = triton.next_power_of_2(head_dim)
    group_pad = triton.next_power_of_2(group)
    if max_query_len <= 1:
        # Pure decode: one token per sequence, so a tile only needs the head group.
        block_m = group_pad
    else:
        block_m = 64 if dim_pad <= 128 else 32
    block_n = 64 if dim_pad <= 64 else 32
    return max(block_m, group_pad, _MIN_DOT_DIM), max(block_n, _MIN_DOT_DIM)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of ``query [num_tokens, num_heads, head_dim]`` over the paged
    cache, for a flat batch of prefill chunks and decode tokens. Returns a tensor of
    the query's shape and dtype."""
    block_m, block_n = _choose_tiles(meta.max_query_len, _group_size(query, k_cache), query.shape[2])
    return _paged_attention(query, k_cache, v_cache, meta, scale, block_m=block_m, block_n=block_n)


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
    if block_m < max(group, _MIN_DOT_DIM) or block_n < _MIN_DOT_DIM:
        raise ValueError(f"tiles too small: block_m={block_m}, block_n={block_n}, group={group}")

    out = torch.empty_like(query)
    num_seqs = meta.seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    tokens_per_tile = block_m // group
    grid = (triton.cdiv(meta.max_query_len, tokens_per_tile), num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale * _LOG2E,
        *query.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *meta.block_tables.stride(),
        GROUP=group,
        HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    return out


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
