"""Turns one step's logits into the next token of every request in the batch.

Order (as in vLLM/HF/OpenAI): min_tokens suppression -> repetition penalty ->
presence/frequency penalties -> logit bias -> greedy argmax, or temperature -> top_k ->
top_p -> min_p -> sample. Logprobs are reported from the raw logits, before any of that.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from .sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplingRow:
    """One request's view for this step."""

    params: SamplingParams
    prompt_token_ids: list[int]  # repetition_penalty covers prompt + output (HF style)
    output_token_ids: list[int]  # presence/frequency penalties count only these (OpenAI style)
    generator: torch.Generator | None  # per-request RNG when params.seed is set
    eos_token_ids: frozenset[int]  # banned, with stop_token_ids, until min_tokens are out


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # of the sampled token, even when it is not among `top`
    top: list[tuple[int, float]]  # params.logprobs best (token_id, logprob), best first


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


def _is_greedy(params: SamplingParams) -> bool:
    # top_k=1 is routed to argmax so it matches greedy exactly, ties included.
    return params.greedy or params.top_k == 1


def _flat_index(token_lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs for scattering many rows' token lists in one op."""
    lengths = torch.tensor([len(t) for t in token_lists], device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
    cols = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    return rows, cols


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """For each row of ``logits``: the logprob of its token in ``token_ids`` and its
    ``num_top`` best alternatives, from the raw distribution (log_softmax in float32)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(token_ids, dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, index).squeeze(1).tolist()
    # topk(0) yields empty rows, so num_top 0 everywhere needs no special case.
    top_vals, top_ids = logprobs.topk(min(max(num_top), logprobs.shape[1]), dim=-1)
    return [
        TokenLogprobs(token, logprob, list(zip(ids[:n], vals[:n])))
        for token, logprob, n, ids, vals in zip(token_ids, chosen, num_top, top_ids.tolist(), top_vals.tolist())
    ]


# top_p looks for its tokens among this many best ones first: a partial top-k instead of
# sorting a 128k-152k vocabulary per row.
_TOP_P_CANDIDATES = 1024


def _top_p_drop(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens top_p drops: those whose better tokens' mass already reaches it.
    Every kept token is among the best candidates once their mass reaches top_p (any
    other has at least that much before it); rows whose candidates fall short (a flat
    distribution) make the whole batch sort every token."""
    count = min(_TOP_P_CANDIDATES, probs.shape[1])
    values, order = probs.topk(count, dim=-1)
    if count < probs.shape[1] and bool((values.sum(dim=-1, keepdim=True) < top_p).any()):
        values, order = probs.sort(dim=-1, descending=True)
    drop_sorted = values.cumsum(dim=-1) - values >= top_p
    return torch.ones_like(probs, dtype=torch.bool).scatter_(1, order, drop_sorted)


class Sampler:
    """Stateless; per-request state (history, RNG) arrives in the rows."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if not rows:
            return SamplerOutput([], [])
        penalized = self.penalized_logits(logits, rows)
        greedy = [i for i, r in enumerate(rows) if _is_greedy(r.params)]
        if len(greedy) == len(rows):
            token_ids = penalized.argmax(dim=-1)
        else:
            token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            if greedy:
                token_ids[greedy] = penalized[greedy].argmax(dim=-1)
            sampled = [i for i, r in enumerate(rows) if not _is_greedy(r.params)]
            token_ids[sampled] = self._sample(penalized[sampled], [rows[i] for i in sampled])

        ids: list[int] = token_ids.tolist()  # one device sync for the whole batch
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if lp_rows:
            # vLLM's default "raw logprobs": the model's own distribution, untouched by sampling settings.
            found = token_logprobs(logits[lp_rows], [ids[i] for i in lp_rows],
                                   [rows[i].params.logprobs or 0 for i in lp_rows])
            for i, lp in zip(lp_rows, found):
                logprobs[i] = lp
        return SamplerOutput(ids, logprobs)

    def penalized_logits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """float32 copy of `logits` after min_tokens suppression, the three penalties and the logit bias.

        This is what greedy rows take the argmax of; the input is never modified.
        """
        logits = logits.to(torch.float32, copy=True)
        device, vocab = logits.device, logits.shape[1]

        # min_tokens: ban EOS and stop tokens so the request cannot end too early.
        banned = [
            (i, t)
            for i, r in enumerate(rows)
            if len(r.output_token_ids) < r.params.min_tokens
            for t in r.eos_token_ids | set(r.params.stop_token_ids)
            if 0 <= t < vocab
        ]
        if banned:
            b_rows, b_cols = zip(*banned)
            logits[list(b_rows), list(b_cols)] = _NEG_INF

        # Repetition penalty (HF): every distinct token seen in prompt or output is
        # pushed towards "less likely" -- divided if positive, multiplied if negative.
        rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
        if rep:
            seen = torch.zeros(len(rep), vocab, dtype=torch.bool, device=device)
            seen[_flat_index([rows[i].prompt_token_ids + rows[i].output_token_ids for i in rep], device)] = True
            penalty = _column([rows[i].params.repetition_penalty for i in rep], device)
            sub = logits[rep]
            logits[rep] = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)

        # Presence/frequency penalties (OpenAI): subtract per occurrence and once per token.
        pf = [i for i, r in enumerate(rows) if r.params.presence_penalty or r.params.frequency_penalty]
        if pf:
            counts = torch.zeros(len(pf), vocab, dtype=torch.float32, device=device)
            index = _flat_index([rows[i].output_token_ids for i in pf], device)
            counts.index_put_(index, torch.ones(index[0].numel(), device=device), accumulate=True)
            freq = _column([rows[i].params.frequency_penalty for i in pf], device)
            pres = _column([rows[i].params.presence_penalty for i in pf], device)
            logits[pf] = logits[pf] - freq * counts - pres * (counts > 0)

        # Logit bias (OpenAI): added last, so +100 forces a token and -100 bans it, greedy or not.
        # (vLLM adds it before the penalties; only repetition_penalty's scaling tells the two apart.)
        bias = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias.items()]
        if bias:
            b_rows, b_cols, b_values = zip(*bias)
            index = (torch.tensor(b_rows, device=device), torch.tensor(b_cols, device=device))
            logits.index_put_(index, torch.tensor(b_values, dtype=torch.float32, device=device), accumulate=True)
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Sample one token per row of (already penalised) float32 logits."""
        device, vocab = logits.device, logits.shape[1]
        logits = logits / _column([r.params.temperature for r in rows], device)

        # top_k: keep tokens at least as large as the k-th largest (ties at the edge stay).
        top_k = [i for i, r in enumerate(rows) if 0 < r.params.top_k < vocab]
        if top_k:
            ks = torch.tensor([rows[i].params.top_k for i in top_k], device=device)
            sub = logits[top_k]
            kth = sub.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1).unsqueeze(1))
            logits[top_k] = sub.masked_fill(sub < kth, _NEG_INF)

        # top_p: drop a token once the mass of the better tokens already reaches top_p;
        # the best token has zero mass before it, so it always survives.
        top_p = [i for i, r in enumerate(rows) if r.params.top_p < 1.0]
        if top_p:
            sub = logits[top_p]
            drop = _top_p_drop(sub.softmax(dim=-1), _column([rows[i].params.top_p for i in top_p], device))
            logits[top_p] = sub.masked_fill(drop, _NEG_INF)

        # min_p: relative to the best token, so renormalising earlier does not change it.
        min_p = [i for i, r in enumerate(rows) if r.params.min_p > 0]
        if min_p:
            sub = logits[min_p]
            probs = sub.softmax(dim=-1)
            floor = _column([rows[i].params.min_p for i in min_p], device) * probs.max(dim=-1, keepdim=True).values
            logits[min_p] = sub.masked_fill(probs < floor, _NEG_INF)

        # Exponential race: argmax(p / q) with q ~ Exp(1) picks token i with probability p_i.
        # Each seeded row draws exactly `vocab` numbers from its own generator per step, so
        # its tokens do not depend on what else is in the batch.
        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            q[unseeded] = torch.empty(len(unseeded), vocab, device=device).exponential_()
        for i, r in enumerate(rows):
            if r.generator is not None:
                q[i].exponential_(generator=r.generator)
        # q == 0 is possible in principle; 0/0 would be NaN, which argmax treats as the max.
        q.clamp_(min=torch.finfo(torch.float32).tiny)
        return (probs / q).argmax(dim=-1)
