"""CUDA graphs for decode steps: a step whose sequences each bring one new token (or a few:
speculative decoding's drafts) replays a graph of the whole model forward, captured at
load, instead of launching its hundreds of kernels one by one from Python.

A graph replays fixed kernels on fixed addresses, so it is captured once per *shape*
(``GraphShape``: sequences, rows, the longest sequence's rows) over static input buffers.
A batch runs in the smallest shape that holds it: the runner adds padding sequences of
one to ``query_len`` rows each that write no cache slot (slot -1) and read only block 0
(their outputs are dropped), copies the batch into the static buffers, replays, and reads
the real rows of the static output. The shapes:

- decode buckets: 1, 2, 4, then every multiple of 8 sequences of one token, as vLLM does;
- with speculative decoding (``num_speculative_tokens`` K), one sequence of exactly
  1 + k tokens for each k up to K (the one-user case, where a step's launches weigh most,
  with no padding at all);
- and for several sequences verifying drafts, ``2b`` sequences over ``b (K + 2)`` rows for
  each decode bucket b up to MAX_VERIFY_CAPTURE: any b sequences of 1 to K + 1 tokens fit
  with padding sequences of 1 to K + 1 rows (their lengths differ from request to request,
  so they are not padded within; spare sequences take the spare rows).

Prefill steps, and batches larger than the largest shape, run eagerly. A draft model's steps
are captured in the same shapes (its one-token steps, its catch-ups after verifications).

What a captured forward may not do: read a value back to the host, copy from host
memory, or take a launch decision from per-step host data. The Triton path takes its
grids from shapes and ``max_query_len`` (the shape's ``query_len``); each sequence's
length comes from ``query_start_loc`` on the device; the attention metadata's host lists
keep their capture-time values, which no CUDA kernel reads.

The shapes and padding are plain code (tested on the CPU); the capture itself is
``CudaGraphCapture``, which tests replace with one that re-runs the forward on the static
buffers (graph semantics without a GPU).
"""

from __future__ import annotations

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
# Batches of several sequences verifying drafts above this run eagerly: by then a verified
# row costs about what it yields (adaptive.py), so few of their sequences draft.
MAX_VERIFY_CAPTURE = 32


@dataclass(frozen=True, slots=True)
class GraphShape:
    """A captured forward's batch: ``sequences`` sequences over ``rows`` rows, none of
    more than ``query_len`` rows."""

    sequences: int
    rows: int
    query_len: int

    @property
    def kind(self) -> str:
        """"decode" (one token a sequence), "verify" (one sequence, drafts) or
        "verify batch" (several sequences, drafts)."""
        if self.query_len == 1:
            return "decode"
        return "verify" if self.sequences == 1 else "verify batch"

    def padding(self, sequences: int, rows: int) -> list[int] | None:
        """The rows of each padding sequence that fills this shape up from a batch of
        ``sequences`` sequences over ``rows`` rows (each 1 to ``query_len`` rows), or None
        when the batch does not fit (its sequences' own lengths are checked apart)."""
        spare, extra = self.sequences - sequences, self.rows - rows
        if spare < 0 or not spare <= extra <= spare * self.query_len:
            return None
        if spare == 0:
            return []
        each, longer = divmod(extra, spare)
        return [each + 1] * longer + [each] * (spare - longer)


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The decode buckets: 1, 2, 4, each multiple of 8, and the largest batch, up to
    ``min(max_num_seqs, limit)``."""
    top = min(max_num_seqs, limit)
    sizes = {size for size in (1, 2, 4) if size <= top} | set(range(8, top + 1, 8)) | {top}
    return sorted(sizes)


def graph_shapes(max_num_seqs: int, num_speculative_tokens: int = 0) -> list[GraphShape]:
    """Every shape an engine captures (see the module doc), smallest first."""
    sizes = capture_sizes(max_num_seqs)
    shapes = [GraphShape(size, size, 1) for size in sizes]
    if num_speculative_tokens:
        longest = num_speculative_tokens + 1
        shapes += [GraphShape(1, length, length) for length in range(2, longest + 1)]
        shapes += [GraphShape(2 * size, size * (longest + 1), longest) for size in sizes
                   if 2 <= size <= MAX_VERIFY_CAPTURE]
    return sorted(shapes, key=lambda shape: (shape.rows, shape.sequences))


def describe(shapes: Sequence[GraphShape]) -> str:
    """The shapes in words, for the log."""
    def sequences(kind: str) -> list[int]:
        return sorted(shape.sequences for shape in shapes if shape.kind == kind)

    decode = sequences("decode")
    words = f"decode batches of 1 to {decode[-1]} sequences ({len(decode)} sizes)"
    if drafts := max((shape.query_len - 1 for shape in shapes if shape.kind == "verify"), default=0):
        words += f", and for one sequence verifying 1 to {drafts} draft tokens"
    if batches := sequences("verify batch"):
        words += f", and for 2 to {batches[-1] // 2} sequences verifying drafts ({len(batches)} sizes)"
    return words


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


def padded_shape(num_new_tokens: Sequence[int], shapes: Sequence[GraphShape]) -> GraphShape | None:
    """The smallest of ``shapes`` (sorted by rows) that holds a batch of sequences with
    these numbers of new tokens, or None: it runs eagerly."""
    if not num_new_tokens:
        return None
    sequences, rows, longest = len(num_new_tokens), sum(num_new_tokens), max(num_new_tokens)
    return next((shape for shape in shapes
                 if longest <= shape.query_len and shape.padding(sequences, rows) is not None), None)


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
    """The buffers every graph reads, sized for the largest shape; a shape reads their
    first rows and sequences."""

    input_ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    slot_mapping: torch.Tensor  # [rows] int64
    query_start_loc: torch.Tensor  # [sequences + 1] int32
    seq_lens: torch.Tensor  # [sequences] int32
    block_tables: torch.Tensor  # [sequences, max_blocks_per_seq] int32

    @staticmethod
    def nbytes(rows: int, sequences: int, max_blocks_per_seq: int) -> int:
        """What ``allocate`` takes: three int64 values per row, an int32 offset and
        length per sequence, one more offset, and the block tables."""
        return rows * 3 * 8 + sequences * 2 * 4 + 4 + sequences * max_blocks_per_seq * 4

    @classmethod
    def allocate(cls, rows: int, sequences: int, max_blocks_per_seq: int, device: torch.device) -> StaticInputs:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            input_ids=zeros(rows, dtype=torch.int64),
            positions=zeros(rows, dtype=torch.int64),
            slot_mapping=zeros(rows, dtype=torch.int64),
            query_start_loc=zeros(sequences + 1, dtype=torch.int32),
            seq_lens=zeros(sequences, dtype=torch.int32),
            block_tables=zeros(sequences, max_blocks_per_seq, dtype=torch.int32),
        )

    def metadata(self, shape: GraphShape, max_seq_len: int) -> AttentionMetadata:
        """The attention metadata of a graph of ``shape``: views of these buffers; on the
        host, bounds (no sequence longer than ``max_seq_len``) and the lengths ``shape_for``
        gives its capture, not a replay's."""
        lengths = self._padding_alone(shape)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:shape.rows],
            query_start_loc=self.query_start_loc[: shape.sequences + 1],
            seq_lens=self.seq_lens[:shape.sequences],
            block_tables=self.block_tables[:shape.sequences],
            max_query_len=shape.query_len,
            max_seq_len=max_seq_len,
            query_lens_host=lengths,
            seq_lens_host=lengths,
        )

    @staticmethod
    def _padding_alone(shape: GraphShape) -> list[int]:
        lengths = shape.padding(0, 0)
        assert lengths is not None, shape
        return lengths

    def shape_for(self, shape: GraphShape) -> None:
        """Fill the shape with padding sequences alone (each from position 0, writing no
        slot, reading block 0), so a capture's warm-up run reads a consistent batch and
        writes nothing to the cache."""
        lengths = self._padding_alone(shape)
        offsets = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self.query_start_loc[: shape.sequences + 1].copy_(offsets)
        self.seq_lens[:shape.sequences].copy_(torch.tensor(lengths, dtype=torch.int32))
        self.positions[:shape.rows].copy_(torch.cat([torch.arange(length) for length in lengths]))
        self.slot_mapping[:shape.rows].fill_(-1)
        self.block_tables[:shape.sequences].fill_(0)

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
    """One captured forward per shape (see the module doc), replayed for the steps that fit."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache], shapes: Sequence[GraphShape],
                 max_model_len: int, block_size: int, device: torch.device, capture: Capture) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.shapes = sorted(shapes, key=lambda shape: (shape.rows, shape.sequences))
        self.max_model_len = max_model_len
        self.capture_fn = capture
        self.static = StaticInputs.allocate(max(shape.rows for shape in shapes),
                                            max(shape.sequences for shape in shapes),
                                            -(-max_model_len // block_size), device)
        self.graphs: dict[GraphShape, tuple[Graph, torch.Tensor]] = {}
        self.replays: Counter[GraphShape] = Counter()

    def capture(self) -> None:
        """Capture every graph, largest first (the pool is then as large as it gets at once)."""
        for shape in reversed(self.shapes):
            self.static.shape_for(shape)
            meta = self.static.metadata(shape, self.max_model_len)
            input_ids, positions = self.static.input_ids[:shape.rows], self.static.positions[:shape.rows]

            def forward(input_ids: torch.Tensor = input_ids, positions: torch.Tensor = positions,
                        meta: AttentionMetadata = meta) -> torch.Tensor:
                return self.model(input_ids, positions, self.kv_caches, meta)

            self.graphs[shape] = self.capture_fn(forward)

    def padded_shape(self, num_new_tokens: Sequence[int]) -> GraphShape | None:
        """The shape this batch replays in, or None (see ``padded_shape``)."""
        return padded_shape(num_new_tokens, self.shapes)

    def replay(self, shape: GraphShape, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[rows, hidden]`` of a batch padded to ``shape``: the graph's
        static output, valid until the next replay."""
        graph, out = self.graphs[shape]
        self.replays[shape] += 1
        self.static.load(input_ids, positions, meta)
        graph.replay()
        return out
