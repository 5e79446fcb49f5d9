"""Plain-torch paged attention: the definition of correct, and the CPU path.

Decode rows (one query token) of the whole batch go through one batched SDPA call
over their gathered blocks; prefill rows go one sequence at a time. Inputs to SDPA
are always 4-D: on CPU, 3-D inputs and many small calls fall onto slow paths.

An 8-bit cache (int8, or float8 e4m3) stores each token's head vector as codes plus
one float32 scale, ``amax / qmax``: per token, so a token is quantized once when it
is written and never again, and per head, since heads differ in range by orders of
magnitude. Attention dequantizes to the query dtype before its matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .paged_kv import KV_QMAX, MIN_KV_SCALE, AttentionMetadata


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., dim]`` as ``dtype`` codes and float32 scales ``[...]``; codes round to
    nearest, ties to even."""
    qmax = KV_QMAX[dtype]
    x = x.float()
    # amax times the fp32 reciprocal of qmax, written out: torch on CUDA turns a division by
    # a scalar into that product and on the CPU does not, so "/ qmax" would give scales that
    # differ by an ulp between devices (and from the Triton kernel, which does the same).
    scale = (x.abs().amax(-1) * (1.0 / qmax)).clamp_min(MIN_KV_SCALE)
    y = (x / scale[..., None]).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = torch.round(y)
    return y.to(dtype), scale


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale[..., None]).to(dtype)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store ``key``/``value`` ``[tokens, kv_heads, dim]`` at their slots; an 8-bit cache
    (``k_scale``/``v_scale`` given, ``[blocks, block_size, kv_heads]``) stores codes and scales."""
    for new, cache, scales in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        flat = cache.view(-1, *cache.shape[2:])
        if scales is None:
            flat.index_copy_(0, slot_mapping, new.to(cache.dtype))
        else:
            codes, scale = quantize_kv(new, cache.dtype)
            # As bytes: CPU index_copy_ has no float8 kernel.
            flat.view(torch.uint8).index_copy_(0, slot_mapping, codes.view(torch.uint8))
            scales.view(-1, scales.shape[2]).index_copy_(0, slot_mapping, scale)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The first ``num_blocks`` blocks of each table, as ``[batch, kv_heads, tokens, ...]``
    (``...`` is the head dim for a cache, nothing for its scales)."""
    batch = block_tables.shape[0]
    # index_select on flat block ids copies far faster on CPU than advanced indexing.
    ids = block_tables[:, :num_blocks].reshape(-1).long()
    blocks = cache.index_select(0, ids).view(batch, -1, *cache.shape[2:])
    return blocks.transpose(1, 2)


def gather_kv(cache: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor, num_blocks: int,
              dtype: torch.dtype) -> torch.Tensor:
    """``gather_blocks`` of a cache, dequantized to ``dtype``."""
    blocks = gather_blocks(cache, block_tables, num_blocks)
    if scales is None:
        return blocks.to(dtype)
    return dequantize_kv(blocks, gather_blocks(scales, block_tables, num_blocks), dtype)


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
    """Prefill chunks one sequence at a time; the decode tokens together. Under a sliding
    ``window`` the query at position p sees the keys at positions p - window < j <= p.
    ``softcap`` > 0 squashes each scaled score s to ``softcap * tanh(s / softcap)``
    (Gemma 2); ``sinks`` (one logit per query head, GPT-OSS) join every row's softmax
    as a column that takes weight but has no value."""
    variant = Variant(scale, window, softcap, sinks)
    if meta.max_query_len == 1:  # decodes only (most steps): every row, in order
        return decode_attention(query, k_cache, v_cache, meta, list(range(meta.num_seqs)), variant, k_scale, v_scale)
    out = torch.empty_like(query)
    decodes = prefill_attention(query, k_cache, v_cache, meta, variant, k_scale, v_scale, out)
    if decodes:
        rows = meta.query_start_loc[torch.tensor(decodes, device=query.device)].long()
        out[rows] = decode_attention(query[rows], k_cache, v_cache, meta, decodes, variant, k_scale, v_scale)
    return out


@dataclass(frozen=True, slots=True)
class Variant:
    """How a layer's attention scores its keys (see ``paged_attention``)."""

    scale: float
    window: int | None = None
    softcap: float = 0.0
    sinks: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``q [B, H, Lq, D]`` over ``k``/``v [B, KV, Lk, D]`` where ``mask`` (broadcast to
        ``[B, H, Lq, Lk]``) allows. Plain softmax attention goes through SDPA; soft-capped
        or sink scores are written out, in fp32."""
        gqa = q.shape[1] != k.shape[1]
        if not self.softcap and self.sinks is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        if gqa:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scores = q.float() @ k.float().transpose(-1, -2) * self.scale
        if self.softcap:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        if self.sinks is not None:
            sink = self.sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
            weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            weights = torch.softmax(scores, dim=-1)
        return (weights @ v.float()).to(q.dtype)


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      variant: Variant, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                      out: torch.Tensor) -> list[int]:
    """Writes ``out``'s rows of the sequences with more than one new token; returns the
    indices of the others (one new token each: decodes)."""
    block_size = k_cache.shape[1]
    decodes: list[int] = []
    row = 0
    for b, (query_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        if query_len == 1:
            decodes.append(b)
        else:
            num_blocks = -(-seq_len // block_size)
            table = meta.block_tables[b : b + 1]
            k = gather_kv(k_cache, k_scale, table, num_blocks, query.dtype)[:, :, :seq_len]
            v = gather_kv(v_cache, v_scale, table, num_blocks, query.dtype)[:, :, :seq_len]
            q = query[row : row + query_len].transpose(0, 1).unsqueeze(0)
            # Query i is position seq_len - query_len + i and sees keys 0..that position.
            q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
            key_pos = torch.arange(seq_len, device=query.device)
            mask = key_pos <= q_pos[:, None]
            for start, end in (meta.bidirectional or {}).get(b, ()):
                mask |= ((q_pos >= start) & (q_pos < end))[:, None] & (key_pos >= start) & (key_pos < end)
            if variant.window:
                mask &= key_pos > q_pos[:, None] - variant.window
            o = variant.attend(q, k, v, mask)
            out[row : row + query_len] = o[0].transpose(0, 1)
        row += query_len
    return decodes


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     decodes: list[int], variant: Variant, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence (``query [len(decodes), heads, dim]``):
    every sequence's blocks gathered up to the longest, padding masked."""
    index = torch.tensor(decodes, device=query.device)
    seq_lens = meta.seq_lens[index]
    num_blocks = -(-max(meta.seq_lens_host[b] for b in decodes) // k_cache.shape[1])
    tables = meta.block_tables[index]
    k = gather_kv(k_cache, k_scale, tables, num_blocks, query.dtype)
    v = gather_kv(v_cache, v_scale, tables, num_blocks, query.dtype)
    key_pos = torch.arange(k.shape[2], device=query.device)
    mask = key_pos < seq_lens[:, None].long()
    if variant.window:
        mask &= key_pos >= seq_lens[:, None].long() - variant.window  # the token at seq_len - 1 sees `window` keys
    # Slots past a sequence's length may never have been written (a float cache in host
    # memory is allocated uninitialized, see KVCache.allocate), and the mask alone does not
    # stop a NaN there: it poisons the scores (NaN + -inf) and P @ V (0 * NaN). Zero them
    # in the gathered copies (fresh tensors, not views of the cache).
    padding = ~mask[:, None, :, None]
    k.masked_fill_(padding, 0)
    v.masked_fill_(padding, 0)
    return variant.attend(query.unsqueeze(2), k, v, mask[:, None, None, :]).squeeze(2)
