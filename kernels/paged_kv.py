"""The paged KV cache and the batches attention reads it for: the data types every
attention kernel shares (attention.py picks the kernel).

Cache layout (a ``KVCache`` per layer): ``key``/``value`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``t`` of a sequence lives
in block ``block_table[t // block_size]`` at offset ``t % block_size``; its *slot* is
``block * block_size + offset``.

A batch is flat: the new tokens of all sequences are concatenated, sequence ``b``
owning rows ``query_start_loc[b]:query_start_loc[b+1]``. Those rows are the last
``query_len`` tokens of a sequence whose cache holds ``seq_len`` tokens once this
step's keys are written, so new token ``i`` sits at position
``seq_len - query_len + i`` and attends causally to cache positions ``<= `` its own.

An 8-bit cache (int8 or float8 e4m3) adds per-token, per-head float32 scales of
shape ``[num_blocks, block_size, num_kv_heads]`` (``amax / qmax`` per token and head; see ``attention_ref.quantize_kv``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The largest code of each 8-bit cache dtype.
KV_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# Floor for a scale, so an all-zero head vector divides by something: its codes are 0.
MIN_KV_SCALE = 1e-30


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs to know about one batch, passed explicitly."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [batch + 1] int32: row offsets of each sequence
    seq_lens: torch.Tensor  # [batch] int32: cached tokens after this step's write
    block_tables: torch.Tensor  # [batch, max_blocks] int32, padded (padding never read)
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU code can loop without device syncs.
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # Sequence index -> position ranges [start, end) whose tokens also see each other's
    # keys, not only those before them (an image's tokens in Gemma 3); each range lies
    # within what the sequence has cached after this step. None: causal everywhere.
    bidirectional: dict[int, list[tuple[int, int]]] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


@dataclass(slots=True)
class KVCache:
    """One layer's paged cache."""

    key: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value: torch.Tensor
    key_scale: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads] float32, 8-bit caches
    value_scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, pin_memory: bool = False) -> KVCache:
        """A cache; ``dtype`` int8 or float8_e4m3fn makes it 8-bit, with scales. A float
        cache in (unpinned) host memory is left unwritten, so its pages become resident as
        blocks are first used instead of all at start (no kernel reads a slot no sequence
        has written, and the reference zeroes those it gathers, so NaN there cannot leak);
        the others are zeroed (the reference dequantizes whole 8-bit blocks before masking)."""
        lazy = torch.device(device).type == "cpu" and not pin_memory and not is_8bit(dtype)

        def make(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            if lazy:
                return torch.empty(shape, dtype=dtype, device=device)
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)

        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if not is_8bit(dtype):
            return cls(make(*shape, dtype=dtype), make(*shape, dtype=dtype))
        return cls(make(*shape, dtype=dtype), make(*shape, dtype=dtype),
                   make(*shape[:3], dtype=torch.float32), make(*shape[:3], dtype=torch.float32))

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one token takes in one layer: its keys and values, plus their scales."""
        per_head = head_dim * torch.empty((), dtype=dtype).element_size() + (4 if is_8bit(dtype) else 0)
        return 2 * num_kv_heads * per_head

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block first (what moving a block must copy)."""
        return [t for t in (self.key, self.value, self.key_scale, self.value_scale) if t is not None]


def is_8bit(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds quantized codes with scales."""
    return dtype in KV_QMAX
