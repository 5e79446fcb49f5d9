"""A batch of inputs packed without padding: their tokens concatenated into one run of
rows, each input's rows a contiguous span that attends only to itself. Every matmul then
works on real tokens only, however mixed the lengths."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import LocalserveError
from .config import EncoderConfig


@dataclass(slots=True)
class PackedBatch:
    input_ids: torch.Tensor  # [tokens]
    type_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]: learned-table rows, or rotary positions
    spans: list[tuple[int, int]]  # each input's (first row, length), in input order
    starts: torch.Tensor  # [inputs]: each input's first row
    ends: torch.Tensor  # [inputs]: one past each input's last row
    segments: torch.Tensor  # [tokens]: the input each row belongs to

    @property
    def num_inputs(self) -> int:
        return len(self.spans)


def pack(inputs: Sequence[Sequence[int]], type_ids: Sequence[Sequence[int]] | None, config: EncoderConfig,
         max_length: int, device: torch.device) -> PackedBatch:
    """The inputs packed for the model, checked first: none empty or over ``max_length``, ids
    in the vocabulary, segment ids within the model's (ignored for a model with one segment
    type, as RoBERTa's tokenizers hand the model none)."""
    if not inputs:
        raise LocalserveError("no inputs to encode")
    if type_ids is not None and [len(t) for t in type_ids] != [len(i) for i in inputs]:
        raise LocalserveError("each input needs one segment id per token")
    lengths = [len(ids) for ids in inputs]
    for index, length in enumerate(lengths):
        if not 1 <= length <= max_length:
            raise LocalserveError(f"input {index} has {length:,} tokens; an input takes 1 to {max_length:,}")
    input_ids = _ids([token for ids in inputs for token in ids], config.vocab_size, "token ids")
    if type_ids is None or config.type_vocab_size == 1:
        types = torch.zeros_like(input_ids)
    else:
        types = _ids([t for ids in type_ids for t in ids], config.type_vocab_size, "segment ids")
    counts = torch.tensor(lengths, dtype=torch.int64)
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    segments = torch.repeat_interleave(torch.arange(len(lengths)), counts)
    positions = torch.arange(len(input_ids)) - starts[segments]
    if config.family == "roberta":
        # transformers' rule: a token's position is the pad id plus the count of non-pad
        # tokens up to it in its input, and a pad token's is the pad id itself.
        real = (input_ids != config.pad_token_id).long()
        seen = torch.cumsum(real, 0)
        before = (seen - real)[starts]  # non-pad tokens of earlier inputs
        positions = (seen - before[segments]) * real + config.pad_token_id
    spans = list(zip(starts.tolist(), lengths))
    return PackedBatch(input_ids.to(device), types.to(device), positions.to(device), spans, starts.to(device),
                       ends.to(device), segments.to(device))


def _ids(values: list[int], bound: int, what: str) -> torch.Tensor:
    try:
        ids = torch.tensor(values, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError, OverflowError):  # not integers, or past int64
        ids = None
    if ids is None or int(ids.min()) < 0 or int(ids.max()) >= bound:
        raise LocalserveError(f"{what} must be integers in [0, {bound})")
    return ids
