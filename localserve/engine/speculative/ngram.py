"""Prompt lookup: draft tokens from the sequence itself.

The proposal for a sequence ending in tokens ``s`` (its last n) is what followed the
latest earlier occurrence of ``s``, longest n first. The search is a vectorized compare
over the sequence (a few microseconds for thousands of tokens), against a copy of the
token ids kept per request (state.TokenHistory).
"""

from __future__ import annotations

import numpy as np

from .drafter import PerRequestDrafter


class NgramDrafter(PerRequestDrafter):
    """The ``ngram`` method's drafter (see ``propose``)."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, request: object, tokens: np.ndarray, count: int) -> list[int]:
        return propose(tokens, count, self.ngram_min, self.ngram_max)


def propose(tokens: np.ndarray, num_tokens: int, ngram_min: int, ngram_max: int) -> list[int]:
    """``num_tokens`` tokens that followed the latest earlier occurrence of the sequence's
    last n tokens, for the largest n in [ngram_min, ngram_max] that occurs (where they run
    into the end, the repeating part continued); [] when none does."""
    length = tokens.shape[0]
    if num_tokens <= 0:
        return []
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        # Windows starting at 0 .. length - n - 1: each ends before the last token, so
        # at least one token follows it (the suffix itself is the window at length - n).
        starts = length - n
        match = tokens[:starts] == tokens[starts]
        for j in range(1, n):
            match &= tokens[j : starts + j] == tokens[starts + j]
        found = np.flatnonzero(match)
        if found.size:
            begin = int(found[-1]) + n
            draft = tokens[begin : begin + num_tokens].tolist()
            # A match near the end runs into the sequence's end: the text is then repeating
            # with period length - begin (a line, a phrase, a token over and over), and the
            # draft goes on repeating it.
            period = length - begin
            while len(draft) < num_tokens:
                draft.append(draft[len(draft) - period])
            return draft
    return []
