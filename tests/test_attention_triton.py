"""The Triton paged-attention kernels against the plain-torch reference.

On a CUDA machine the kernels are compiled and run on the GPU; elsewhere they run on
CPU tensors in the Triton interpreter, so sizes are kept small. The dispatcher in
``attention.py`` only picks Triton for CUDA tensors, hence the direct calls here.
"""

import pytest
import torch

from .conftest import triton_or_skip

# conftest.py sets TRITON_INTERPRET=1 on machines without CUDA, before anything
# imports triton (the interpreter must be chosen before the first import).
triton, DEVICE, INTERPRETED = triton_or_skip()

from localserve.kernels import attention_ref, attention_triton  # noqa: E402
from localserve.kernels.attention import AttentionMetadata  # noqa: E402
from localserve.kernels.attention_ref import KV_QMAX, quantize_kv  # noqa: E402


def unowned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Cache contents no sequence owns: NaN, or for int8 codes -128, which quantizing
    never produces (codes are clamped to +-127)."""
    if dtype == torch.int8:
        return torch.full(shape, -128, dtype=dtype)
    return torch.full(shape, float("nan")).to(dtype)



TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    # The kernel rounds the softmax probabilities to the input dtype before P @ V.
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}

# A batch mixing every kind of sequence the engine schedules, as (query_len, seq_len):
# a fresh prefill crossing a block boundary, a prefill chunk after 21 cached tokens,
# and decode tokens at a short sequence, exactly at a block end, and just past one.
MIXED = [(17, 17), (9, 30), (1, 5), (1, 16), (1, 33)]


class Batch:
    """Random inputs for one step plus a cache holding each sequence's earlier tokens.

    Every cache slot that no sequence owns (unused pool blocks, the tail of each
    sequence's last block, this step's slots before they are written) holds NaN, so
    reading anything the kernel should have masked poisons the output.
    """

    def __init__(
        self,
        shape: list[tuple[int, int]],
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        cache_dtype: torch.dtype | None = None,
        spare_blocks: int = 5,
        seed: int = 0,
        device: torch.device = DEVICE,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        cache_dtype = cache_dtype or dtype
        query_lens = [q for q, _ in shape]
        seq_lens = [s for _, s in shape]
        assert all(0 < q <= s for q, s in shape)
        blocks_per_seq = [-(-s // block_size) for s in seq_lens]
        max_blocks = max(blocks_per_seq)
        num_blocks = sum(blocks_per_seq) + spare_blocks

        # Blocks are drawn without replacement from a shuffled pool, so each sequence's
        # blocks are scattered and out of order. Table padding points at a spare (NaN)
        # block: a valid index (the reference may gather it, then mask it out), whose
        # contents the kernel must never let into its output.
        pool = torch.randperm(num_blocks, generator=gen)
        block_tables = torch.full((len(shape), max_blocks), int(pool[-1]), dtype=torch.int32)
        used = 0
        for b, n in enumerate(blocks_per_seq):
            block_tables[b, :n] = pool[used : used + n]
            used += n

        def slots(b: int, positions: range) -> list[int]:
            return [int(block_tables[b, p // block_size]) * block_size + p % block_size for p in positions]

        new_slots: list[int] = []
        context_slots: list[int] = []
        for b, (q, s) in enumerate(shape):
            context_slots += slots(b, range(s - q))
            new_slots += slots(b, range(s - q, s))

        cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = unowned(cache_shape, cache_dtype)
        self.v_cache = unowned(cache_shape, cache_dtype)
        quantized = cache_dtype in KV_QMAX
        self.k_scale = unowned(cache_shape[:3], torch.float32) if quantized else None
        self.v_scale = unowned(cache_shape[:3], torch.float32) if quantized else None
        ctx = torch.tensor(context_slots, dtype=torch.long)
        kv_shape = (len(context_slots), num_kv_heads, head_dim)
        for cache, scales in ((self.k_cache, self.k_scale), (self.v_cache, self.v_scale)):
            context = torch.randn(kv_shape, generator=gen)
            if scales is None:
                cache.view(-1, num_kv_heads, head_dim)[ctx] = context.to(cache_dtype)
            else:
                codes, scale = quantize_kv(context, cache_dtype)
                cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)[ctx] = codes.view(torch.uint8)
                scales.view(-1, num_kv_heads)[ctx] = scale

        num_tokens = sum(query_lens)
        self.query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
        self.key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
        self.value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
        self.scale = head_dim**-0.5

        query_start_loc = torch.zeros(len(shape) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
        self.meta = AttentionMetadata(
            slot_mapping=torch.tensor(new_slots, dtype=torch.long),
            query_start_loc=query_start_loc,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
        )
        # Built on CPU, so a seed gives the same batch on every device.
        for name in ("k_cache", "v_cache", "k_scale", "v_scale", "query", "key", "value"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(device))
        for field in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(self.meta, field, getattr(self.meta, field).to(device))

    @property
    def scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.k_scale, self.v_scale

    def write_with_reference(self) -> None:
        attention_ref.write_kv(self.key, self.value, self.k_cache, self.v_cache, self.meta.slot_mapping, *self.scales)

    def reference(self) -> torch.Tensor:
        # The reference may gather unowned slots and mask them in SDPA, where a NaN
        # value still poisons the row (0 * NaN); the NaNs are for the kernel only.
        def clean(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.dtype == torch.int8:
                return t
            return t.float().nan_to_num(0.0).to(t.dtype)

        return attention_ref.paged_attention(self.query, clean(self.k_cache), clean(self.v_cache), self.meta,
                                             self.scale, clean(self.k_scale), clean(self.v_scale))


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert not actual.isnan().any(), "kernel read a slot it should have masked"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[expected.dtype])


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
