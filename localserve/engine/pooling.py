"""Embeddings: an embedding model's last hidden states pooled into one vector per input.

An embedding request is a prompt that is prefilled and never decoded. Its chunks pass
through the scheduler like any prefill; after each forward the runner folds the chunk's
hidden states into the request's pooled state (a running sum for mean pooling, the first
row for CLS, the last for last-token), and when the prompt is done the request finishes
with its vector and its KV blocks are freed.
"""

from __future__ import annotations

import torch

from .sampling_params import PoolingParams

POOLING_METHODS = ("mean", "cls", "last")


def fold_chunk(method: str, state: torch.Tensor | None, chunk: torch.Tensor, start: int,
               reaches_end: bool) -> torch.Tensor | None:
    """The pooled state after a chunk of hidden states (rows for positions ``start``
    onward; ``reaches_end``: it holds the prompt's last token). A chunk from position 0
    starts over, so a request recomputed after preemption is not counted twice."""
    if start == 0:
        state = None
    if method == "mean":
        total = chunk.float().sum(0)
        return total if state is None else state + total
    if method == "cls":
        return chunk[0].float() if start == 0 else state
    return chunk[-1].float() if reaches_end else state


def finish(method: str, state: torch.Tensor, num_tokens: int, params: PoolingParams) -> torch.Tensor:
    """The request's embedding (float32, on the CPU) from its pooled state."""
    vector = state / num_tokens if method == "mean" else state
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.cpu()
