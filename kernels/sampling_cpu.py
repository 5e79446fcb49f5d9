"""The sampler's last steps through the CPU kernels (``csrc/sampling.cpp``): each row's
greedy argmax, or its draw after temperature, top_k, min_p and top_p, with the meaning
``localserve/engine/sampler.py`` gives them (its torch code stays the reference and the GPU's).

On a 128k vocabulary torch takes ~0.2 ms for the argmax and ~1.4 ms for a draw at Ollama's
defaults (temperature 0.8, top_k 40, top_p 0.9): several percent of a small model's decode
step on the CPU. The rows' uniforms come from the caller, one per round of a row's draw, as
the torch code takes them, so a seeded request's generator advances the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import cpu_library
from .dispatch import use_cpu_kernels


def takes(logits: torch.Tensor) -> bool:
    """Whether these logits go through the kernels: contiguous float32 rows on the CPU, the
    engine's choice allowing the CPU kernels, and the kernels built."""
    return (use_cpu_kernels(logits) and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.is_contiguous() and logits.shape[1] > 0 and cpu_library.available())


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first index of its largest value (torch.argmax's answer), int64 ``[rows]``."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib = cpu_library.library()
    assert lib is not None
    lib.ls_argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
    return out


def draw(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float], min_p: list[float],
         uniforms: Callable[[list[int]], torch.Tensor]) -> torch.Tensor:
    """Each row's token, int64 ``[rows]``. ``uniforms(rows)``: one uniform in [0, 1) for each
    of those rows (``[len(rows), 1]``), asked once per round: a row whose draw top_p rejects
    is drawn again with its next one."""
    lib = cpu_library.library()
    assert lib is not None
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    settings = (torch.tensor(temperature, dtype=torch.float32), torch.tensor(top_k, dtype=torch.int64),
                torch.tensor(top_p, dtype=torch.float32), torch.tensor(min_p, dtype=torch.float32))
    drawn = uniforms(list(range(rows))).float().contiguous()
    pending = list(range(rows))
    while pending:
        # A later round replays a row's earlier uniforms (the same rejections) with one more.
        whole = len(pending) == rows
        index = None if whole else torch.tensor(pending)
        sub, temps, ks, ps, mins, u = ((t if whole else t[index].contiguous())
                                       for t in (logits, *settings, drawn))
        found = out if whole else torch.empty(len(pending), dtype=torch.int64)
        lib.ls_sample_rows(sub.data_ptr(), len(pending), vocab, temps.data_ptr(), ks.data_ptr(), ps.data_ptr(),
                           mins.data_ptr(), u.data_ptr(), u.shape[1], found.data_ptr())
        if not whole:
            out[index] = found
        again = [row for row, token in zip(pending, found.tolist()) if token < 0]
        if again:
            more = torch.zeros(rows, 1)
            more[again] = uniforms(again).float()
            drawn = torch.cat([drawn, more], dim=1)
        pending = again
    return out
