"""One vector per input from a packed batch's hidden states, as sentence-transformers'
Pooling and Normalize modules make it; and Matryoshka truncation for a request that asks
for fewer dimensions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .packing import PackedBatch


def pool(hidden: torch.Tensor, batch: PackedBatch, method: str) -> torch.Tensor:
    """[inputs, hidden] in float32: the first row ("cls"), the last ("last") or the mean of
    every row of each input (its special tokens included, as sentence-transformers counts them)."""
    if method == "cls":
        return hidden[batch.starts].float()
    if method == "last":
        return hidden[batch.ends - 1].float()
    sums = torch.zeros(batch.num_inputs, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, batch.segments, hidden.float())
    return sums / (batch.ends - batch.starts).unsqueeze(1).float()


def normalize(vectors: torch.Tensor) -> torch.Tensor:
    return F.normalize(vectors, p=2, dim=-1)


def matryoshka(vectors: torch.Tensor, dimensions: int) -> torch.Tensor:
    """The first ``dimensions`` values of each vector, scaled to unit length again (what a
    Matryoshka-trained model's shorter embeddings are)."""
    return normalize(vectors[..., :dimensions])
