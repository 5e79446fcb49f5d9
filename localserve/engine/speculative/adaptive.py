"""How many tokens a request drafts in a step: as many as pay, from its recent acceptance.

A verified draft token costs a step one more row of the model (weights already streamed
for the first row: a fraction of a step where decode is bound by memory), and yields a token
only while every draft token before it was accepted. With each draft token accepted with
probability a, k draft tokens yield E(k) = (1 - a^(k+1)) / (1 - a) tokens. A step of R rows
costs 1 + c (R - 1) plain one-row steps; with B requests decoding, a request's k drafts turn
a step of B tokens for 1 + c (B - 1) into one of B - 1 + E(k) tokens for 1 + c (B - 1 + k).
A draft model adds its own steps, t of a plain step per draft token (prompt lookup: none).
The request drafts the k that makes the most tokens per cost, and none when no k beats a
plain step: a drafter that keeps missing costs nothing, and where the batch is already big
enough that rows cost what they yield, drafting stops unless nearly every draft is kept.

A draft model must first take in a request's tokens (its whole prompt, the first time): n
tokens cost n rows of its layers (its head meets only a chunk's last token), n c times the
layers' share of the served model's weights. A request starts drafting only when what its
drafts should save over its next tokens pays for that (``pays_back``).
"""

from __future__ import annotations

from dataclasses import dataclass

# c above: a verified row's share of a plain decode step, by device. On the CPU the int8
# kernels stream weights only 2-3x slower than they compute on them, so a row costs: a step
# of Llama-3.2-1B's shape (Q4_K_M, Zen 4) with 1 + k rows took 1.54-1.56, 1.80-1.90 and
# 2.41-2.56 plain steps at k = 2, 4 and 8 (benchmarks/speculative.py, two runs). A GPU's decode step leaves its compute
# nearly idle, so rows cost little there.
DRAFT_ROW_COST = {"cpu": 0.2, "cuda": 0.05}
# Weight of each new outcome in the acceptance rate (an exponential moving average).
SMOOTHING = 0.2
# The rate a request starts from: a new request drafts a token or two, and stops within a
# few steps when its drafts miss.
PRIOR_RATE = 0.5
# A request that drafts none still has one token proposed, unverified, to learn when drafting
# would pay again: every step where that is free (prompt lookup), and where it costs a draft
# model's steps (and a catch-up on the request's tokens), no more of the engine's time than
# this. A new request's first proposal catches the draft up on its whole prompt (0.7 s for 128
# tokens of a 1B draft on 2 cores), which lands in its decode: at 5% a draft that never agreed
# with Llama-3.1-8B paid one per request, 0.91x of its one-client TPOT.
SHADOW_SHARE = 0.02
# The tokens ahead a catch-up is weighed against: a request's remaining max_tokens, at most
# this many (a typical answer's length; many requests allow far more than they use).
PAYBACK_HORIZON = 256


def expected_tokens(rate: float, draft_tokens: int) -> float:
    """Tokens one step yields with ``draft_tokens`` drafts, each accepted with probability
    ``rate`` given those before it were: the accepted ones and the one sampled after."""
    if rate >= 1.0:
        return draft_tokens + 1.0
    return (1.0 - rate ** (draft_tokens + 1)) / (1.0 - rate)


@dataclass(slots=True)
class Acceptance:
    rate: float = PRIOR_RATE

    def observe(self, proposed: int, accepted: int) -> None:
        """A verification of ``proposed`` draft tokens that accepted the first ``accepted``:
        one outcome per token up to and including the first rejected one."""
        for outcome in [1.0] * accepted + ([0.0] if accepted < proposed else []):
            self.rate += SMOOTHING * (outcome - self.rate)

    def draft_length(self, most: int, row_cost: float, decoding: int = 1, token_cost: float = 0.0) -> int:
        """The number of draft tokens, up to ``most``, that makes a step of ``decoding``
        requests yield most tokens per cost, a row costing ``row_cost`` of a one-row step
        and drafting a token ``token_cost`` (a draft model's step; 0 for prompt lookup)."""
        return self._best(most, row_cost, decoding, token_cost)[0]

    def pays_back(self, most: int, row_cost: float, decoding: int, token_cost: float, catch_up: float,
                  horizon: int) -> bool:
        """Whether drafting from now saves, over ``horizon`` more tokens, more than a catch-up
        of ``catch_up`` rows of a served step's weights first costs."""
        _, speedup = self._best(most, row_cost, decoding, token_cost)
        saved = horizon * (1.0 - 1.0 / speedup)  # steps of this request's tokens, in plain steps' cost
        return saved > catch_up * row_cost

    def _best(self, most: int, row_cost: float, decoding: int, token_cost: float) -> tuple[int, float]:
        """The best draft length and its tokens per cost over a plain step's."""
        others = max(decoding, 1) - 1
        plain_cost = 1.0 + row_cost * others
        plain_yield = (others + 1.0) / plain_cost
        best, best_yield = 0, plain_yield
        for k in range(1, most + 1):
            gain = (others + expected_tokens(self.rate, k)) / (plain_cost + (row_cost + token_cost) * k)
            if gain > best_yield * (1 + 1e-9):
                best, best_yield = k, gain
        return best, best_yield / plain_yield
