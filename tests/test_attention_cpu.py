"""The C++ CPU paged attention (``kernels/attention_cpu.py``) against the torch reference,
on batches mixing prefill chunks and decodes whose caches hold NaN wherever no sequence
owns a slot; and its invariance: a row's result does not depend on the rest of the batch
or on how its prompt was chunked."""

from __future__ import annotations

import itertools

import pytest
import torch

from localserve.kernels import AttentionMetadata, KVCache, attention_cpu, attention_ref, cpu_library, paged_attention
from localserve.kernels.dispatch import KernelChoice, using

from .attention_batches import MIXED, Batch, assert_close, sinks_for

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the CPU kernels were not built")

DECODES = [(1, 1), (1, 7), (1, 16), (1, 17), (1, 64), (1, 200)]  # one token each, across block ends


@pytest.mark.parametrize("shape", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize(("head_dim", "block_size"), [(16, 4), (64, 16), (80, 16), (128, 32)])
def test_equals_reference(shape: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                          block_size: int) -> None:
    batch = Batch(shape, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    batch.write_with_reference()
    expected = batch.reference()
    ours = attention_cpu.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(ours, expected)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("shape", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_sliding_window_equals_reference(shape: list[tuple[int, int]], window: int) -> None:
    """Windows shorter than a block, of one block, across blocks, and longer than some
    sequences; the keys before each window hold real values the kernel must skip."""
    batch = Batch(shape, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    batch.write_with_reference()
    ours = attention_cpu.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                         window=window)
    assert_close(ours, batch.reference(window))
    assert not torch.allclose(ours, batch.reference())  # the window mattered


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("softcap", "with_sinks"), [(2.0, False), (0.0, True), (2.0, True)])
@pytest.mark.parametrize("shape", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_softcap_and_sinks_equal_reference(shape: list[tuple[int, int]], softcap: float, with_sinks: bool,
                                           window: int | None) -> None:
    batch = Batch(shape, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    batch.write_with_reference()
    sinks = sinks_for(8) if with_sinks else None
    ours = attention_cpu.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                         window=window, softcap=softcap, sinks=sinks)
    assert_close(ours, batch.reference(window, softcap, sinks))
    assert not torch.allclose(ours, batch.reference(window))  # the variant mattered


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_8bit_caches_take_the_reference(cache_dtype: torch.dtype) -> None:
    batch = Batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=64, cache_dtype=cache_dtype)
    batch.write_with_reference()
    args = (batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale, *batch.scales)
    torch.testing.assert_close(attention_cpu.paged_attention(*args), attention_ref.paged_attention(*args),
                               rtol=0, atol=0, equal_nan=True)


def test_the_dispatcher_picks_it_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = Batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=16)
    batch.write_with_reference()
    calls = []
    kernel = attention_cpu.paged_attention
    monkeypatch.setattr(attention_cpu, "paged_attention", lambda *args: calls.append(1) or kernel(*args))
    cache = KVCache(batch.k_cache, batch.v_cache)
    assert_close(paged_attention(batch.query, cache, batch.meta, batch.scale), batch.reference())
    assert calls == [1]
    with using(KernelChoice(cpu_kernels=False)):  # an engine that keeps the references
        paged_attention(batch.query, cache, batch.meta, batch.scale)
    assert calls == [1]


def test_a_row_is_the_same_however_its_prompt_was_chunked() -> None:
    """A 40-token prompt's rows computed in one step, in chunks of 7 (other sequences
    beside them), and each alone as a decode at its position: the same bits."""
    whole = Batch([(40, 40)], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    whole.write_with_reference()
    expected = attention_cpu.paged_attention(whole.query, whole.k_cache, whole.v_cache, whole.meta, whole.scale)
    meta = whole.meta

    def rows(start: int, stop: int, others: int) -> torch.Tensor:
        """Rows start..stop of the prompt as one step's chunk, after ``others`` one-row
        sequences that reuse the same cache blocks."""
        count = stop - start
        query = torch.cat([whole.query[:1].expand(others, -1, -1), whole.query[start:stop]])
        tables = meta.block_tables.expand(others + 1, -1).contiguous()
        lens = [3 + i for i in range(others)] + [stop]
        query_lens = [1] * others + [count]
        starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
        step = AttentionMetadata(meta.slot_mapping, starts, torch.tensor(lens, dtype=torch.int32), tables,
                                 max(query_lens), max(lens), query_lens, lens)
        return attention_cpu.paged_attention(query.contiguous(), whole.k_cache, whole.v_cache, step,
                                             whole.scale)[others:]

    chunked = torch.cat([rows(start, min(start + 7, 40), others=start % 3) for start in range(0, 40, 7)])
    assert torch.equal(chunked, expected)
    decodes = torch.cat([rows(p, p + 1, others=2) for p in range(40)])
    assert torch.equal(decodes, expected)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_the_thread_count_changes_no_bit(cache_dtype: torch.dtype) -> None:
    """Work is split by rows, and by KV heads where there are few rows (one long decode):
    any split gives the same bits, over many tiles of keys and a window that starts mid-tile."""
    from localserve.kernels import cpu_library

    batch = Batch([(1, 300), (70, 300)], num_heads=16, num_kv_heads=8, head_dim=64, block_size=16,
                  cache_dtype=cache_dtype)
    batch.write_with_reference()
    results = []
    try:
        for threads in (1, 2, 3, 8):
            cpu_library.set_threads(threads)
            results.append([attention_cpu.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta,
                                                          batch.scale, window=window) for window in (None, 37)])
    finally:
        cpu_library.set_threads(torch.get_num_threads())
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    assert_close(results[0][0], batch.reference())
    assert_close(results[0][1], batch.reference(37))


def test_out_of_range_block_ids_are_refused() -> None:
    batch = Batch(DECODES, num_heads=4, num_kv_heads=2, head_dim=16)
    meta = batch.meta
    tables = meta.block_tables.clone()
    tables[0, 0] = batch.k_cache.shape[0]  # one past the pool
    bad = AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, tables, meta.max_query_len,
                            meta.max_seq_len, meta.query_lens_host, meta.seq_lens_host)
    with pytest.raises(RuntimeError, match="bad block id"):
        attention_cpu.paged_attention(batch.query, batch.k_cache, batch.v_cache, bad, batch.scale)
