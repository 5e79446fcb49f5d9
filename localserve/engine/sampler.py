"""Turns one step's logits into the next token of every request in the batch.

Order (as in vLLM/HF/OpenAI): a structured output's grammar mask -> min_tokens suppression -> repetition penalty ->
presence/frequency penalties -> logit bias -> greedy argmax, or temperature -> top_k ->
top_p -> min_p -> sample. Logprobs are reported from the raw logits, before any of that.
Nothing sorts the vocabulary: top_k takes a partial top-k, top_p tests drawn tokens
(see ``_sample``), and a draw is one cumulative sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from ..kernels import sampling_cpu
from .outputs import TokenLogprobs
from .sampling_params import SamplingParams
from .structured_output import allowed_tokens

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
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


def _is_greedy(params: SamplingParams) -> bool:
    # top_k=1 is routed to argmax so it matches greedy exactly, ties included.
    return params.greedy or params.top_k == 1


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return sampling_cpu.argmax(logits) if sampling_cpu.takes(logits) else logits.argmax(dim=-1)


def _flat_index(token_lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs for scattering many rows' token lists in one op."""
    lengths = [len(t) for t in token_lists]
    # output_size known on the host, so the GPU is not asked for it (a sync).
    rows = torch.repeat_interleave(torch.arange(len(token_lists), device=device),
                                   torch.tensor(lengths, device=device), output_size=sum(lengths))
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


def _draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: per row, the token where the cumulative weight passes ``u`` times the
    row's total (``u`` in [0, 1)), token i with probability ``weights_i / total``."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Below the total, so the first entry above the target is a token of non-zero weight.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # A row of NaN (logits an extreme penalty overflowed) finds no entry: keep it in range.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=weights.shape[1] - 1)


class Sampler:
    """Stateless; per-request state (history, RNG) arrives in the rows."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 grammar_masks: tuple[list[int], torch.Tensor] | None = None) -> SamplerOutput:
        """``grammar_masks``: the rows held to a structured output and their bitmasks of
        allowed tokens (``StructuredOutputs.masks``)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if not rows:
            return SamplerOutput([], [])
        penalized = self.penalized_logits(logits, rows, grammar_masks)
        greedy = [i for i, r in enumerate(rows) if _is_greedy(r.params)]
        if len(greedy) == len(rows):
            token_ids = _argmax(penalized)
        elif not greedy:
            token_ids = self._sample(penalized, rows)
        else:
            token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            if greedy:
                token_ids[greedy] = _argmax(penalized[greedy])
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

    def penalized_logits(self, logits: torch.Tensor, rows: list[SamplingRow],
                         grammar_masks: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """float32 `logits` after the grammar masks, min_tokens suppression, the three
        penalties and the logit bias: a copy where any of them applies, else the input itself
        (as float32). This is what greedy rows take the argmax of; the input is never modified.
        """
        vocab = logits.shape[1]
        # min_tokens: ban EOS and stop tokens so the request cannot end too early.
        banned = [
            (i, t)
            for i, r in enumerate(rows)
            if len(r.output_token_ids) < r.params.min_tokens
            for t in r.eos_token_ids | set(r.params.stop_token_ids)
            if 0 <= t < vocab
        ]
        rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
        pf = [i for i, r in enumerate(rows) if r.params.presence_penalty or r.params.frequency_penalty]
        bias = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias.items()]
        if grammar_masks is None and not (banned or rep or pf or bias):
            return logits.float()  # a 128k-vocabulary copy costs a CPU decode step ~0.15 ms
        logits = logits.to(torch.float32, copy=True)
        device = logits.device

        # Structured outputs: what the grammar does not allow is out, whatever comes after.
        if grammar_masks is not None:
            masked, bitmask = grammar_masks
            allowed = allowed_tokens(bitmask.to(device, non_blocking=True), vocab)
            logits[masked] = logits[masked].masked_fill(~allowed, _NEG_INF)

        if banned:
            b_rows, b_cols = zip(*banned)
            logits[list(b_rows), list(b_cols)] = _NEG_INF

        # Repetition penalty (HF): every distinct token seen in prompt or output is
        # pushed towards "less likely" -- divided if positive, multiplied if negative. Only
        # the seen tokens are touched (a token seen twice is written twice, the same value).
        if rep:
            index = _flat_index([rows[i].prompt_token_ids + rows[i].output_token_ids for i in rep], device)
            penalty = torch.tensor([rows[i].params.repetition_penalty for i in rep], device=device)[index[0]]
            index = (torch.tensor(rep, device=device)[index[0]], index[1])
            seen = logits[index]
            logits[index] = torch.where(seen > 0, seen / penalty, seen * penalty)

        # Presence/frequency penalties (OpenAI): subtract per occurrence and once per token.
        if pf:
            counts = torch.zeros(len(pf), vocab, dtype=torch.float32, device=device)
            index = _flat_index([rows[i].output_token_ids for i in pf], device)
            counts.index_put_(index, torch.ones(index[0].numel(), device=device), accumulate=True)
            freq = _column([rows[i].params.frequency_penalty for i in pf], device)
            pres = _column([rows[i].params.presence_penalty for i in pf], device)
            logits[pf] = logits[pf] - freq * counts - pres * (counts > 0)

        # Logit bias (OpenAI): added last, so +100 forces a token and -100 bans it, greedy or not.
        # (vLLM adds it before the penalties; only repetition_penalty's scaling tells the two apart.)
        if bias:
            b_rows, b_cols, b_values = zip(*bias)
            index = (torch.tensor(b_rows, device=device), torch.tensor(b_cols, device=device))
            logits.index_put_(index, torch.tensor(b_values, dtype=torch.float32, device=device), accumulate=True)
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Sample one token per row of (already penalised) float32 logits."""
        device, vocab = logits.device, logits.shape[1]

        # One uniform number per row and draw; a seeded row draws from its own generator
        # only, so its tokens do not depend on what else is in the batch.
        def uniforms(batch: list[int]) -> torch.Tensor:
            u = torch.empty(len(batch), 1, device=device)
            unseeded = [j for j, i in enumerate(batch) if rows[i].generator is None]
            if unseeded:
                u[unseeded] = torch.rand(len(unseeded), 1, device=device)
            for j, i in enumerate(batch):
                if rows[i].generator is not None:
                    u[j] = torch.rand(1, generator=rows[i].generator, device=device)
            return u

        if sampling_cpu.takes(logits):  # the same steps, compiled (kernels/sampling_cpu.py)
            params = [r.params for r in rows]
            return sampling_cpu.draw(logits, [p.temperature for p in params], [p.top_k for p in params],
                                     [p.top_p for p in params], [p.min_p for p in params], uniforms)

        logits = logits / _column([r.params.temperature for r in rows], device)

        # top_k: keep tokens at least as large as the k-th largest (ties at the edge stay).
        top_k = [i for i, r in enumerate(rows) if 0 < r.params.top_k < vocab]
        if top_k:
            ks = [rows[i].params.top_k for i in top_k]
            sub = logits[top_k]
            kth = sub.topk(max(ks), dim=-1).values.gather(1, torch.tensor(ks, device=device).unsqueeze(1) - 1)
            logits[top_k] = sub.masked_fill(sub < kth, _NEG_INF)

        probs = logits.softmax(dim=-1)  # what top_p and min_p judge
        weights = probs  # what is drawn from: zero for what min_p drops

        # min_p: relative to the best token, so renormalising after top_p does not change it.
        min_p = [i for i, r in enumerate(rows) if r.params.min_p > 0]
        if min_p:
            sub = probs[min_p]
            floor = _column([rows[i].params.min_p for i in min_p], device) * sub.max(dim=-1, keepdim=True).values
            weights = probs.clone()
            weights[min_p] = sub.masked_fill(sub < floor, 0.0)

        tokens = _draw(weights, uniforms(list(range(len(rows)))))

        # top_p keeps a token while the mass of the tokens better than it is below top_p
        # (ties at the edge stay). Rather than sort a 128k-152k vocabulary per row, test
        # the drawn token: if it is not kept, neither is any token as likely or less, so
        # they leave the row and it draws again. What is accepted follows the kept tokens'
        # distribution; each draw is accepted with probability at least top_p, and the
        # best token always is, so the loop ends.
        top_p = torch.tensor([r.params.top_p for r in rows], device=device)
        pending = [i for i, r in enumerate(rows) if r.params.top_p < 1.0]
        while pending:
            whole = len(pending) == len(rows)  # the first round of an all-top_p batch: no copies
            sub = probs if whole else probs[pending]
            drawn = sub.gather(1, (tokens if whole else tokens[pending]).unsqueeze(1))
            better = torch.where(sub > drawn, sub, 0.0).sum(dim=-1)
            # better == 0: a best token, kept even when top_p rounds to 0 in float32.
            rejected = ((better >= top_p[pending]) & (better > 0)).tolist()
            pending = [i for i, no in zip(pending, rejected) if no]
            if pending:
                if weights is probs:
                    weights = probs.clone()
                pivot = drawn[[j for j, no in enumerate(rejected) if no]]
                weights[pending] = weights[pending].masked_fill(probs[pending] <= pivot, 0.0)
                tokens[pending] = _draw(weights[pending], uniforms(pending))
        return tokens
