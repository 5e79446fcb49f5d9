"""Batches for the paged-attention tests: random queries and a paged cache whose
unowned slots hold NaN, so a kernel that reads what it should mask poisons its output."""

import torch

from localserve.kernels import attention_ref
from localserve.kernels.attention_ref import quantize_kv
from localserve.kernels.paged_kv import KV_QMAX, AttentionMetadata


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
        device: torch.device = torch.device("cpu"),
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

    def reference(self, window: int | None = None, softcap: float = 0.0,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        # Expected values from clean caches, independent of how the reference itself
        # keeps gathered unowned slots out (test_attention_ref checks that); the NaNs
        # are for the kernel under test.
        def clean(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.dtype == torch.int8:
                return t
            return t.float().nan_to_num(0.0).to(t.dtype)

        return attention_ref.paged_attention(self.query, clean(self.k_cache), clean(self.v_cache), self.meta,
                                             self.scale, clean(self.k_scale), clean(self.v_scale), window, softcap,
                                             sinks)


def sinks_for(num_heads: int, seed: int = 1) -> torch.Tensor:
    """Per-head sink logits around the scores' own range (some heads' sinks outweigh
    most keys, some hardly count), as GPT-OSS's trained sinks are."""
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert not actual.isnan().any(), "kernel read a slot it should have masked"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[expected.dtype])
