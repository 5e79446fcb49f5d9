"""CUDA graphs for decode steps: a step whose sequences each bring one new token replays
a graph of the whole model forward, captured at load, instead of launching its hundreds
of kernels one by one from Python.

A graph replays fixed kernels on fixed addresses, so it is captured once per *bucket*
(a batch size: 1, 2, 4, then every multiple of 8, as vLLM does) over static input
buffers. A batch of ``n`` decodes runs in the smallest bucket ``>= n``: the runner pads
it with rows that write no cache slot (slot -1) and attend to one key, copies it into
the static buffers, replays, and reads the first ``n`` rows of the static output.
Prefill steps, and decode batches larger than the largest bucket, run eagerly.

Speculative decoding adds *verification* graphs: one sequence bringing 1 + k tokens (its
last token and k drafts), for each k up to the engine's ``num_speculative_tokens``; the
one-user case, where a step's launches weigh most. Batches of several sequences with drafts
run eagerly (their lengths differ from request to request).

What a captured forward may not do: read a value back to the host, copy from host
memory, or take a launch decision from per-step host data. The Triton path takes its
grids from shapes and ``max_query_len`` (fixed per graph: 1 in a decode bucket, 1 + k in a
verification graph); the attention metadata's host lists keep their capture-time values,
which no CUDA kernel reads.

The sizes and padding are plain code (tested on the CPU); the capture itself is
``CudaGraphCapture``, which tests replace with one that re-runs the forward on the static
buffers (graph semantics without a GPU).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..kernels import AttentionMetadata, KVCache
from .config import EngineConfig


# Decode batches above this run eagerly: a graph per bucket costs capture time and
# memory, and at this many rows the launch overhead a graph saves is a small share.
MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The buckets: 1, 2, 4, each multiple of 8, and the largest batch, up to
    ``min(max_num_seqs, limit)``."""
    top = min(max_num_seqs, limit)
    sizes = {size for size in (1, 2, 4) if size <= top} | set(range(8, top + 1, 8)) | {top}
    return sorted(sizes)


def why_eager(config: EngineConfig, num_layers: int) -> str | None:
    """Why a CUDA engine with these options captures no graphs, or None when it does."""
    if config.disable_cuda_graphs:
        return "disable_cuda_graphs is set"
    if config.disable_triton:
        # The references loop over the batch's host-side lengths, which a graph would freeze.
        return "the torch references (disable_triton) read each step's lengths on the host"
    if config.cpu_moe_layers(num_layers):
        return "experts in host memory (cpu_moe) run on the CPU in every step"
    return None


def padded_size(num_new_tokens: Sequence[int], sizes: Sequence[int],
                verify_lengths: Sequence[int] = ()) -> int | None:
    """The bucket a batch (its new tokens per sequence) replays in: the smallest size
    holding its sequences when each brings one token, 1 for one sequence verifying drafts
    in a captured length; None when it must run eagerly."""
    if len(num_new_tokens) == 1 and num_new_tokens[0] in verify_lengths:
        return 1
    if not num_new_tokens or any(n != 1 for n in num_new_tokens):
        return None
    index = bisect.bisect_left(sizes, len(num_new_tokens))
    return sizes[index] if index < len(sizes) else None


def verify_lengths(num_speculative_tokens: int) -> list[int]:
    """The query lengths of the verification graphs: 1 + k for k = 1 .. the engine's
    draft tokens (none without speculative decoding)."""
    return list(range(2, num_speculative_tokens + 2))


class Graph(Protocol):
    def replay(self) -> None: ...


# Captures a forward (a callable reading only static buffers) and returns the graph and
# the static tensor its replays write.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Graph, torch.Tensor]]


class CudaGraphCapture:
    """Captures forwards into CUDA graphs that share one memory pool (captured largest
    first, a smaller graph reuses the larger one's activations' memory: only one replays
    at a time)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: tuple[int, int] | None = None

    def __call__(self, forward: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        # A warm-up run outside the capture compiles the Triton kernels and sets up
        # cuBLAS's workspace, neither of which may happen while capturing.
        forward()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the daemon's other engines go on serving from their own threads
        # while this one captures ("global" would fail their CUDA calls meanwhile).
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = forward()
        self.pool = graph.pool()
        return graph, out


@dataclass(slots=True)
class StaticInputs:
    """The buffers every graph reads, sized for the largest bucket; a bucket of ``size``
    reads their first ``size`` rows."""

    input_ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    slot_mapping: torch.Tensor  # [rows] int64
    query_start_loc: torch.Tensor  # [rows + 1] int32
    seq_lens: torch.Tensor  # [rows] int32
    block_tables: torch.Tensor  # [rows, max_blocks_per_seq] int32

    @staticmethod
    def nbytes(rows: int, max_blocks_per_seq: int) -> int:
        """What ``allocate`` takes: three int64 and two int32 values per row, one more
        offset, and the block tables."""
        return rows * (3 * 8 + 2 * 4) + 4 + rows * max_blocks_per_seq * 4

    @classmethod
    def allocate(cls, rows: int, max_blocks_per_seq: int, device: torch.device) -> StaticInputs:
        # Filled as padding: every row one token at position 0 writing no slot, reading
        # block 0, so a capture writes nothing to the cache.
        def fill(value: int, *shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full(shape, value, dtype=dtype, device=device)

        return cls(
            input_ids=fill(0, rows, dtype=torch.int64),
            positions=fill(0, rows, dtype=torch.int64),
            slot_mapping=fill(-1, rows, dtype=torch.int64),
            query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=device),
            seq_lens=fill(1, rows, dtype=torch.int32),
            block_tables=fill(0, rows, max_blocks_per_seq, dtype=torch.int32),
        )

    def metadata(self, size: int, max_seq_len: int, query_len: int = 1) -> AttentionMetadata:
        """The attention metadata of a graph of ``size`` sequences of ``query_len`` tokens:
        views of these buffers; bounds, not values, on the host (no sequence longer than
        ``max_seq_len``)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size * query_len],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=query_len,
            max_seq_len=max_seq_len,
            query_lens_host=[query_len] * size,
            seq_lens_host=[query_len] * size,
        )

    def shape_for(self, size: int, query_len: int) -> None:
        """Set the offsets and lengths of ``size`` padding sequences of ``query_len``
        tokens (writing no slot), so a capture's warm-up run reads a consistent batch."""
        rows = size * query_len
        self.query_start_loc[: size + 1].copy_(torch.arange(0, rows + 1, query_len, dtype=torch.int32))
        self.seq_lens[:size].fill_(query_len)
        self.positions[:rows].copy_(torch.arange(query_len).repeat(size))
        self.slot_mapping[:rows].fill_(-1)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copy a padded batch in (device to device, outside any graph). Rows past it keep
        stale values, which its graph never reads; block-table columns past the batch's
        widest table too, which no key position reaches."""
        rows, size = input_ids.shape[0], meta.seq_lens.shape[0]
        width = meta.block_tables.shape[1]
        self.input_ids[:rows].copy_(input_ids, non_blocking=True)
        self.positions[:rows].copy_(positions, non_blocking=True)
        self.slot_mapping[:rows].copy_(meta.slot_mapping, non_blocking=True)
        self.query_start_loc[: size + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.seq_lens[:size].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:size, :width].copy_(meta.block_tables, non_blocking=True)


class DecodeGraphs:
    """One captured forward per bucket, replayed for decode steps, and one per
    verification length, replayed for one sequence's drafts."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache], sizes: Sequence[int], max_model_len: int,
                 block_size: int, device: torch.device, capture: Capture, verify_lengths: Sequence[int] = ()) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.verify_lengths = sorted(verify_lengths)
        self.max_model_len = max_model_len
        self.capture_fn = capture
        rows = max(self.sizes[-1], *self.verify_lengths) if self.verify_lengths else self.sizes[-1]
        self.static = StaticInputs.allocate(rows, -(-max_model_len // block_size), device)
        self.graphs: dict[int, tuple[Graph, torch.Tensor]] = {}  # decode buckets, by size
        self.verify_graphs: dict[int, tuple[Graph, torch.Tensor]] = {}  # one sequence, by query length
        self.replays: Counter[int] = Counter()  # per bucket
        self.verify_replays: Counter[int] = Counter()  # per query length

    def capture(self) -> None:
        """Capture every graph, largest first (the pool is then as large as it gets at once)."""
        shapes = [(size, 1) for size in self.sizes] + [(1, length) for length in self.verify_lengths]
        for size, query_len in sorted(shapes, key=lambda shape: shape[0] * shape[1], reverse=True):
            rows = size * query_len
            self.static.shape_for(size, query_len)
            meta = self.static.metadata(size, self.max_model_len, query_len)
            input_ids, positions = self.static.input_ids[:rows], self.static.positions[:rows]

            def forward(input_ids: torch.Tensor = input_ids, positions: torch.Tensor = positions,
                        meta: AttentionMetadata = meta) -> torch.Tensor:
                return self.model(input_ids, positions, self.kv_caches, meta)

            graphs = self.graphs if query_len == 1 else self.verify_graphs
            graphs[size if query_len == 1 else query_len] = self.capture_fn(forward)
        self.static.shape_for(self.sizes[-1], 1)

    def padded_size(self, num_new_tokens: Sequence[int]) -> int | None:
        """The bucket this batch replays in, or None (see ``padded_size``)."""
        return padded_size(num_new_tokens, self.sizes, self.verify_lengths)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[rows, hidden]`` of a batch padded to a bucket (or of one
        sequence verifying drafts): the graph's static output, valid until the next replay."""
        rows, size = input_ids.shape[0], meta.seq_lens.shape[0]
        if rows == size:
            graph, out = self.graphs[size]
            self.replays[size] += 1
        else:
            graph, out = self.verify_graphs[rows]
            self.verify_replays[rows] += 1
        self.static.load(input_ids, positions, meta)
        graph.replay()
        return out
