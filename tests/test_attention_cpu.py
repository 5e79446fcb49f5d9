"""The C++ CPU paged decode attention (``kernels/attention_cpu.py``) against the torch
reference, on batches mixing prefill chunks and decodes whose caches hold NaN wherever no
sequence owns a slot."""

from __future__ import annotations

import shutil

import pytest
import torch

from localserve.kernels import AttentionMetadata, KVCache, attention_cpu, attention_ref, cpu_extension, paged_attention

from .attention_batches import MIXED, Batch, assert_close

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

DECODES = [(1, 1), (1, 7), (1, 16), (1, 17), (1, 64), (1, 200)]  # one token each, across block ends


@pytest.mark.parametrize("shape", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize(("head_dim", "block_size"), [(16, 4), (64, 16), (80, 16), (128, 32)])
def test_equals_reference(shape: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                          block_size: int) -> None:
    assert cpu_extension.available()
    batch = Batch(shape, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    batch.write_with_reference()
    expected = batch.reference()
    ours = attention_cpu.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(ours, expected)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_8bit_caches_take_the_reference(cache_dtype: torch.dtype) -> None:
    batch = Batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=64, cache_dtype=cache_dtype)
    batch.write_with_reference()
    args = (batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale, *batch.scales)
    torch.testing.assert_close(attention_cpu.paged_attention(*args), attention_ref.paged_attention(*args),
                               rtol=0, atol=0, equal_nan=True)


def test_the_dispatcher_picks_it_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = Batch(DECODES, num_heads=4, num_kv_heads=2, head_dim=16)
    batch.write_with_reference()
    calls = []
    kernel = cpu_extension.extension().paged_decode_attention  # type: ignore[union-attr]
    monkeypatch.setattr(attention_cpu.cpu_extension, "extension",
                        lambda: type("Spy", (), {"paged_decode_attention": staticmethod(
                            lambda *args: calls.append(1) or kernel(*args))}))
    cache = KVCache(batch.k_cache, batch.v_cache)
    assert_close(paged_attention(batch.query, cache, batch.meta, batch.scale), batch.reference())
    assert calls == [1]
    monkeypatch.setenv("LOCALSERVE_DISABLE_CPU_KERNELS", "1")
    paged_attention(batch.query, cache, batch.meta, batch.scale)
    assert calls == [1]


def test_out_of_range_block_ids_are_refused() -> None:
    batch = Batch(DECODES, num_heads=4, num_kv_heads=2, head_dim=16)
    meta = batch.meta
    tables = meta.block_tables.clone()
    tables[0, 0] = batch.k_cache.shape[0]  # one past the pool
    bad = AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, tables, meta.max_query_len,
                            meta.max_seq_len, meta.query_lens_host, meta.seq_lens_host)
    with pytest.raises(RuntimeError, match="bad block id"):
        attention_cpu.paged_attention(batch.query, batch.k_cache, batch.v_cache, bad, batch.scale)
