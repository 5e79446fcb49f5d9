"""The torch paged-attention reference against naive dense attention written out
by hand (explicit scores, causal mask, softmax), on mixed batches."""

from __future__ import annotations

import math

import pytest
import torch

from localserve.kernels import AttentionMetadata, KVCache, paged_attention, write_kv
from localserve.kernels import attention_ref
from localserve.kernels.attention_ref import dequantize_kv, quantize_kv

from .attention_batches import MIXED, Batch, assert_close, sinks_for

EIGHT_BIT = [torch.int8, torch.float8_e4m3fn]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    window: int | None = None, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [q_len, H, D] are the last q_len positions of k/v [seq_len, KV, D]; under a
    sliding window, the query at position p sees keys p - window + 1 .. p. A soft cap
    bounds each score by tanh; a head's sink is one more softmax logit, whose weight is
    dropped (as transformers' eager GPT-OSS attention writes it)."""
    q_len, heads = q.shape[0], q.shape[1]
    seq_len, kv_heads = k.shape[0], k.shape[1]
    out = torch.empty_like(q)
    for h in range(heads):
        kh, vh = k[:, h // (heads // kv_heads)], v[:, h // (heads // kv_heads)]
        for i in range(q_len):
            end = seq_len - q_len + i + 1
            start = max(0, end - window) if window else 0
            scores = (kh[start:end] @ q[i, h]) * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            if sinks is not None:
                weights = torch.softmax(torch.cat([scores, sinks[h : h + 1]]), dim=0)[:-1]
            else:
                weights = torch.softmax(scores, dim=0)
            out[i, h] = weights @ vh[start:end]
    return out


# (window, softcap, sinks): plain; sliding windows of 5 tokens (over 4-token blocks) and of
# 1 (each token sees only itself); a soft cap small enough to bend most scores; sinks;
# and all three at once (GPT-OSS's sliding layers have a window and sinks).
VARIANTS = [(None, 0.0, False), (5, 0.0, False), (1, 0.0, False), (None, 1.5, False), (None, 0.0, True),
            (5, 1.5, True)]


@pytest.mark.parametrize("window,softcap,with_sinks", VARIANTS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, *EIGHT_BIT])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_mixed_batch_equals_naive(heads: int, kv_heads: int, cache_dtype: torch.dtype, window: int | None,
                                  softcap: float, with_sinks: bool) -> None:
    """An 8-bit cache must equal naive attention over the keys and values as quantized
    and dequantized one token at a time; a sliding window crosses block boundaries in
    prefill and decode rows. fp32 runs the C++ kernel, 8-bit caches the reference."""
    torch.manual_seed(0)
    dim, block_size, num_blocks = 16, 4, 64
    # (cached context, new tokens): fresh prefill, chunk after context, decodes.
    shapes = [(0, 9), (6, 5), (13, 1), (0, 1), (22, 1), (3, 7)]
    cache = KVCache.allocate(num_blocks, block_size, kv_heads, dim, cache_dtype, torch.device("cpu"))
    free = torch.randperm(num_blocks).tolist()  # blocks out of order in the pool
    tables, keys, values, full_k, full_v, queries, slots = [], [], [], [], [], [], []
    for context, new in shapes:
        total = context + new
        table = [free.pop() for _ in range(math.ceil(total / block_size))]
        tables.append(table)
        k, v = torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
        keys.append(k)
        values.append(v)
        full_k.append(k if cache_dtype == torch.float32 else dequantize_kv(*quantize_kv(k, cache_dtype), k.dtype))
        full_v.append(v if cache_dtype == torch.float32 else dequantize_kv(*quantize_kv(v, cache_dtype), v.dtype))
        positions = range(total)
        slot = torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions])
        # Context is already cached; this step writes the new tokens through write_kv.
        write_kv(k[:context], v[:context], cache, slot[:context])
        slots.append(slot[context:])
        queries.append(torch.randn(new, heads, dim))
    new_k = torch.cat([k[c:] for k, (c, _) in zip(keys, shapes)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(values, shapes)])
    slot_mapping = torch.cat(slots)
    write_kv(new_k, new_v, cache, slot_mapping)

    width = max(map(len, tables))
    query_lens = [n for _, n in shapes]
    seq_lens = [c + n for c, n in shapes]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
    )
    scale = dim**-0.5
    sinks = sinks_for(heads) if with_sinks else None
    out = paged_attention(torch.cat(queries), cache, meta, scale, window, softcap, sinks)
    expected = torch.cat([naive_attention(q, k, v, scale, window, softcap, sinks)
                          for q, k, v in zip(queries, full_k, full_v)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.int8)])
def test_unwritten_slots_do_not_leak_into_the_reference(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """A CPU float cache starts uninitialized (KVCache.allocate), and the reference is the
    CPU path without the compiled kernels: NaN in slots no sequence has written (a block's
    tail, table padding) must not reach a decode row through the masked SDPA."""
    batch = Batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=16, dtype=dtype, cache_dtype=cache_dtype)
    batch.write_with_reference()
    out = attention_ref.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                        *batch.scales)
    assert_close(out, batch.reference())


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_quantize_kv_follows_its_definition(dtype: torch.dtype) -> None:
    """Scale = amax / qmax per head vector; every value comes back within the format's
    rounding error of it; all-zero vectors stay zero rather than NaN."""
    torch.manual_seed(0)
    # Heads of very different ranges, as real keys have, and one all-zero vector.
    x = torch.randn(5, 3, 32) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[2, 1] = 0
    codes, scale = quantize_kv(x, dtype)
    assert codes.dtype == dtype and scale.shape == (5, 3) and scale.dtype == torch.float32
    qmax = {torch.int8: 127, torch.float8_e4m3fn: 448}[dtype]
    amax = x.abs().amax(-1)
    torch.testing.assert_close(scale[amax > 0], amax[amax > 0] / qmax)
    assert codes.float().abs().amax(-1)[amax > 0].eq(qmax).all(), "the largest value maps to the largest code"
    restored = dequantize_kv(codes, scale, torch.float32)
    assert restored[2, 1].eq(0).all()
    # int8: half a step of the scale; e4m3 (3 mantissa bits): 1/16 of the value, or
    # half its smallest subnormal step (2**-10 of the scale) near zero.
    if dtype == torch.int8:
        bound = scale[..., None] / 2
    else:
        bound = torch.maximum(x.abs() / 16, scale[..., None] * 2**-10)
    assert ((restored - x).abs() <= bound * (1 + 1e-6)).all()
    relative = (restored - x).norm() / x.norm()
    assert relative < (0.01 if dtype == torch.int8 else 0.04)


def test_variants_are_checked() -> None:
    batch = Batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=16)
    cache = KVCache(batch.k_cache, batch.v_cache)
    for kwargs, message in ((dict(softcap=-1.0), "soft cap"), (dict(sinks=torch.zeros(3)), "sinks"),
                            (dict(sinks=torch.zeros(4, dtype=torch.float16)), "sinks")):
        with pytest.raises(ValueError, match=message):
            paged_attention(batch.query, cache, batch.meta, batch.scale, **kwargs)
