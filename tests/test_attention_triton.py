"""The Triton paged-attention kernels against the plain-torch reference.

On a CUDA machine the kernels are compiled and run on the GPU; elsewhere they run on
CPU tensors in the Triton interpreter, so sizes are kept small. The dispatcher in
``attention.py`` only picks Triton for CUDA tensors, hence the direct calls here.
"""

import functools

import pytest
import torch

from .conftest import triton_or_skip

# conftest.py sets TRITON_INTERPRET=1 on machines without CUDA, before anything
# imports triton (the interpreter must be chosen before the first import).
triton, DEVICE, INTERPRETED = triton_or_skip()
# The GPU proof (scripts/gpu_proof.sh) runs these on the device: `pytest -m gpu`.
pytestmark = pytest.mark.gpu

from localserve.kernels import attention_ref, attention_triton  # noqa: E402

from .attention_batches import MIXED, TOLERANCE, assert_close, sinks_for  # noqa: E402
from .attention_batches import Batch as CpuBatch  # noqa: E402

Batch = functools.partial(CpuBatch, device=DEVICE)


# --------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        # Not fp32 -> bf16: the interpreter truncates where torch and the GPU round.
        (torch.float32, torch.float16),
    ],
)
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(2, 64), (3, 80)])
def test_write_kv_matches_reference(
    dtype: torch.dtype, cache_dtype: torch.dtype, num_kv_heads: int, head_dim: int
) -> None:
    batch = Batch(
        MIXED,
        num_heads=num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        cache_dtype=cache_dtype,
    )
    k_expected, v_expected = batch.k_cache.clone(), batch.v_cache.clone()
    attention_ref.write_kv(batch.key, batch.value, k_expected, v_expected, batch.meta.slot_mapping)

    attention_triton.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)

    # equal_nan: untouched slots must still hold their NaN.
    torch.testing.assert_close(batch.k_cache, k_expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(batch.v_cache, v_expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(2, 64), (3, 80)])
def test_write_kv_8bit_matches_reference(
    dtype: torch.dtype, cache_dtype: torch.dtype, num_kv_heads: int, head_dim: int
) -> None:
    """Codes and scales bit for bit; padded heads and dims must not touch the scales."""
    batch = Batch(MIXED, num_heads=num_kv_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                  cache_dtype=cache_dtype)
    expected = [t.clone() for t in (batch.k_cache, batch.v_cache, batch.k_scale, batch.v_scale)]
    attention_ref.write_kv(batch.key, batch.value, *expected[:2], batch.meta.slot_mapping, *expected[2:])

    attention_triton.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping,
                              *batch.scales)

    actual = (batch.k_cache, batch.v_cache, batch.k_scale, batch.v_scale)
    for got, want in zip(actual, expected):
        # As bytes: equal codes, and NaN left where nothing was written.
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_write_kv_skips_negative_slots() -> None:
    batch = Batch([(5, 20), (3, 3)], num_heads=2, num_kv_heads=2, head_dim=32)
    slots = batch.meta.slot_mapping.clone()
    padded = torch.tensor([1, 6])  # one token in each sequence becomes padding
    slots[padded] = -1
    keep = slots >= 0
    k_expected, v_expected = batch.k_cache.clone(), batch.v_cache.clone()
    attention_ref.write_kv(batch.key[keep], batch.value[keep], k_expected, v_expected, slots[keep])

    attention_triton.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, slots)

    torch.testing.assert_close(batch.k_cache, k_expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(batch.v_cache, v_expected, rtol=0, atol=0, equal_nan=True)
    # The skipped tokens' own slots were left untouched (still NaN).
    skipped = batch.meta.slot_mapping[padded]
    assert batch.k_cache.view(-1, 2, 32)[skipped].isnan().all()
    assert batch.v_cache.view(-1, 2, 32)[skipped].isnan().all()


# --------------------------------------------------------------------------------------
# paged_attention
# --------------------------------------------------------------------------------------


# The Triton interpreter does not do bfloat16 arithmetic (it keeps bf16 as raw uint16 and
# its tl.dot multiplies the bit patterns, triton-lang/triton#11584), so bf16 attention
# can only be checked on a GPU; bf16 loads/stores/casts do work and write_kv covers them.
BF16_NEEDS_GPU = pytest.mark.skipif(INTERPRETED, reason="Triton interpreter has no bfloat16 tl.dot")


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=BF16_NEEDS_GPU)]
)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [
        pytest.param(8, 2, 64, id="gqa-d64"),
        pytest.param(2, 2, 64, id="mha-d64"),
        pytest.param(4, 1, 80, id="mqa-d80"),
    ],
)
def test_paged_attention_mixed_batch(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    batch = Batch(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    batch.write_with_reference()

    out = attention_triton.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)

    assert_close(out, batch.reference())


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("shape", [MIXED, [(1, 1), (1, 17), (1, 64), (1, 200)]], ids=["mixed", "decodes"])
def test_paged_attention_sliding_window(shape: list[tuple[int, int]], window: int) -> None:
    """Windows shorter than a key tile, of one cache block, across tiles, and longer than
    some sequences, in prefill tiles and decode rows; with 16x16 tiles too."""
    batch = Batch(shape, num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    batch.write_with_reference()
    expected = batch.reference(window)
    out = attention_triton.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                           window=window)
    assert_close(out, expected)
    small = attention_triton._paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                              window=window, block_m=16, block_n=16)
    assert_close(small, expected)
    assert not torch.allclose(out, batch.reference())  # the window mattered


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("window", "softcap", "with_sinks"), [(None, 2.0, False), (None, 0.0, True), (5, 2.0, True)])
@pytest.mark.parametrize("shape", [MIXED, [(1, 1), (1, 17), (1, 64), (1, 200)]], ids=["mixed", "decodes"])
def test_paged_attention_softcap_and_sinks(shape: list[tuple[int, int]], window: int | None, softcap: float,
                                           with_sinks: bool, dtype: torch.dtype) -> None:
    """Gemma 2's soft cap and GPT-OSS's sinks (with its window), in prefill tiles and
    decode rows, with default and 16x16 tiles (a sink must count once per row, not per
    key tile)."""
    batch = Batch(shape, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype)
    batch.write_with_reference()
    sinks = sinks_for(8).to(DEVICE) if with_sinks else None
    expected = batch.reference(window, softcap, sinks)
    out = attention_triton.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                           window=window, softcap=softcap, sinks=sinks)
    assert_close(out, expected)
    small = attention_triton._paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                              window=window, softcap=softcap, sinks=sinks, block_m=16, block_n=16)
    assert_close(small, expected)
    assert not torch.allclose(out.float(), batch.reference(window).float(), atol=1e-2)  # the variant mattered


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paged_attention_small_tiles(block_size: int) -> None:
    """16x16 tiles: many query tiles per prefill and many key tiles per sequence, with
    key tiles both spanning several cache blocks and covering part of one."""
    batch = Batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=block_size)
    batch.write_with_reference()

    out = attention_triton._paged_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale, block_m=16, block_n=16
    )

    assert_close(out, batch.reference())


def test_paged_attention_group_not_dividing_tile() -> None:
    """A head group of 3 leaves the last row of each 16-row tile unused."""
    batch = Batch([(11, 11), (6, 25), (1, 9)], num_heads=6, num_kv_heads=2, head_dim=16)
    batch.write_with_reference()

    out = attention_triton._paged_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale, block_m=16, block_n=16
    )

    assert_close(out, batch.reference())


@pytest.mark.parametrize("head_dim", [96, 128])
def test_paged_attention_decode_only(head_dim: int) -> None:
    batch = Batch([(1, 1), (1, 17), (1, 40), (1, 32)], num_heads=4, num_kv_heads=2, head_dim=head_dim)
    batch.write_with_reference()

    out = attention_triton.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)

    assert_close(out, batch.reference())


def test_paged_attention_non_contiguous_query() -> None:
    """Query as a strided view, e.g. a slice of a fused QKV projection."""
    batch = Batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=32)
    batch.write_with_reference()
    fused = torch.cat([batch.query, torch.randn_like(batch.query)], dim=1)
    query = fused[:, :4]
    assert not query.is_contiguous()

    out = attention_triton.paged_attention(query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)

    assert_close(out, batch.reference())


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 2, 64), (4, 1, 80)])
def test_paged_attention_8bit_cache(
    dtype: torch.dtype, cache_dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    batch = Batch(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                  cache_dtype=cache_dtype)
    batch.write_with_reference()

    out = attention_triton.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                           *batch.scales)

    assert_close(out, batch.reference())


def test_paged_attention_8bit_small_tiles() -> None:
    """Scale lookups per key, with key tiles spanning several cache blocks."""
    batch = Batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, cache_dtype=torch.int8)
    batch.write_with_reference()

    out = attention_triton._paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                            *batch.scales, block_m=16, block_n=16)

    assert_close(out, batch.reference())


def test_8bit_cache_needs_matching_scales() -> None:
    batch = Batch([(3, 3)], num_heads=2, num_kv_heads=2, head_dim=16, cache_dtype=torch.int8)
    with pytest.raises(ValueError, match="needs scales"):
        attention_triton.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    with pytest.raises(ValueError, match="together"):
        attention_triton.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping,
                                  batch.k_scale, None)
    with pytest.raises(ValueError, match="float32"):
        attention_triton.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                         batch.k_scale.half(), batch.v_scale.half())


def test_write_then_attend_with_triton() -> None:
    """The two kernels together, as a model layer uses them."""
    batch = Batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    attention_triton.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)

    out = attention_triton.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)

    assert_close(out, batch.reference())
