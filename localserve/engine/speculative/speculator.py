"""The engine's one entry into speculative decoding.

Before a step is scheduled, ``propose`` gives each running request that is decoding its
draft tokens (``Request.draft_token_ids``); the scheduler gives it 1 + k query tokens,
and the runner samples each of the k + 1 positions as a plain decode of that position
would (the same sampling options, with the drafts before it as output history). After the
step, ``accept`` keeps the drafts up to the first one the sampled token differs from,
and the sampled token after them.

That is exact for any drafter that proposes deterministically (prompt lookup does): at
greedy the accepted tokens are those plain decoding produces; when sampling, a draft token
d is kept with probability p(d) (the sampled token equals it) and otherwise the sampled
token follows p without d, renormalized: the speculative sampling rule for a draft
distribution that is all on d, so the output follows the target's distribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .adaptive import DRAFT_ROW_COST, PAYBACK_HORIZON, SHADOW_SHARE, Acceptance
from .config import SpeculativeConfig
from .drafter import Drafter, DraftQuery
from .ngram import NgramDrafter
from .state import RequestSpeculation

if TYPE_CHECKING:
    from ..request import Request

ALWAYS_KEPT = Acceptance(rate=1.0)


@dataclass(slots=True)
class SpeculationStats:
    num_drafts: int = 0  # verifications of one or more draft tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, device_type: str = "cpu",
                 drafter: Drafter | None = None) -> None:
        """``drafter``: the draft model's (draft_model.py), else the config's method's own
        (a test or benchmark may put a drafter of its own on ``self.drafter``). Prompt
        lookup is always there too, for requests that ask for it."""
        self.config = config
        self.max_model_len = max_model_len
        self.row_cost = DRAFT_ROW_COST.get(device_type, DRAFT_ROW_COST["cuda"])
        self.stats = SpeculationStats()
        self.lookup = NgramDrafter(config.ngram_min, config.ngram_max)
        # Every request's outcomes: where a new request's acceptance starts (a draft model
        # that has kept agreeing drafts from a request's first step).
        self.acceptance = Acceptance()
        # Seconds of shadow proposals not yet paid for by SHADOW_SHARE of the time since.
        self.shadow_debt = 0.0
        self.last_step = time.monotonic()
        self.drafter: Drafter = drafter or self.lookup

    def propose(self, running: list[Request]) -> None:
        """Set each running request's draft tokens for the next step ([] for most)."""
        now = time.monotonic()
        self.shadow_debt = max(0.0, self.shadow_debt - SHADOW_SHARE * (now - self.last_step))
        self.last_step = now
        decoding = sum(1 for r in running if r.num_computed_tokens == r.num_tokens - 1)
        asked: dict[int, tuple[Drafter, list[DraftQuery], list[int]]] = {}  # by drafter
        for request in running:
            request.draft_token_ids = []
            drafter = self.drafter_of(request)
            query = self._query(request, decoding, drafter)
            if query is not None:
                _, queries, counts = asked.setdefault(id(drafter), (drafter, [], []))
                queries.append(query[0])
                counts.append(query[1])
        for drafter, queries, counts in asked.values():
            start = time.monotonic()
            self._take(queries, counts, drafter.propose_all(queries))
            if drafter.token_cost and not any(counts):  # shadow proposals alone: their time is owed
                self.shadow_debt += time.monotonic() - start

    def drafter_of(self, request: Request) -> Drafter:
        """The drafter the request asked for (prompt lookup, or the engine's), else the engine's."""
        method = request.params.speculative_method
        return self.lookup if method == "ngram" and self.config.method != "ngram" else self.drafter

    def _take(self, queries: list[DraftQuery], counts: list[int], proposals: list[list[int]]) -> None:
        for query, count, proposal in zip(queries, counts, proposals):
            state = query.request.speculation
            assert state is not None
            if count == 0:  # not drafting: the proposal is only checked against what comes
                if proposal:
                    state.shadow = (query.tokens.shape[0], proposal[0])
            else:
                query.request.draft_token_ids = self._allowed(query.request, proposal[:count])

    @staticmethod
    def _allowed(request: Request, drafts: list[int]) -> list[int]:
        """The drafts the request's structured output lets it verify: those its grammar
        allows; while it still thinks before the grammar's part, those before the token
        that would close its thinking (a position after it is the grammar's, which this
        step's masks, taken while thinking, would not hold to it)."""
        if (constraint := request.active_constraint) is not None:
            return drafts[:constraint.valid_prefix(drafts)]
        end = request.params.thinking_end
        if request.params.output_format is None or not end:
            return drafts
        closing = list(end)
        window = request.output_token_ids[-(len(closing) - 1):] if len(closing) > 1 else []
        for index, token in enumerate(drafts):
            window = (window + [token])[-len(closing):]
            if window == closing:
                return drafts[:index]
        return drafts

    def release(self, request: Request) -> None:
        if request.speculation is not None:
            self.drafter_of(request).release(request.request_id)

    def accept(self, request: Request, sampled: list[int]) -> int:
        """How many of ``sampled`` (one token per verified position: 1 + its drafts) the
        request keeps: the drafts up to the first the sampled token differs from, and the
        sampled token after them."""
        drafts = request.draft_token_ids
        accepted = 0
        while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
            accepted += 1
        if drafts:
            self.stats.num_drafts += 1
            self.stats.num_draft_tokens += len(drafts)
            self.stats.num_accepted_tokens += accepted
            assert request.speculation is not None
            self._observe(request.speculation, len(drafts), accepted)
        return accepted + 1

    def _observe(self, state: RequestSpeculation, proposed: int, accepted: int) -> None:
        """An outcome for the request's acceptance and for the drafter's (where new
        requests start from)."""
        state.acceptance.observe(proposed, accepted)
        self.acceptance.observe(proposed, accepted)

    def _query(self, request: Request, decoding: int, drafter: Drafter) -> tuple[DraftQuery, int] | None:
        """What to ask the drafter for the request, and how many of its tokens to verify
        (0: a shadow proposal, see RequestSpeculation); None: nothing."""
        most = self._most_drafts(request)
        if most == 0:
            return None
        state = request.speculation
        if state is None:  # a new request starts from the drafter's recent acceptance
            state = request.speculation = RequestSpeculation(acceptance=Acceptance(self.acceptance.rate))
        tokens = state.history.sync(request.token_ids)
        if state.shadow is not None:
            position, token = state.shadow
            self._observe(state, 1, int(tokens[position] == token))
            state.shadow = None
        count = most
        if self.config.adaptive:
            count = state.acceptance.draft_length(most, self.row_cost, decoding, drafter.token_cost)
            if count and drafter.token_cost and not self._pays_back(state.acceptance, request, most, decoding,
                                                                    drafter, len(tokens)):
                count = 0
        if count == 0 and ((drafter.token_cost and self.shadow_debt > 0)
                           or not self._could_pay(most, decoding, drafter.token_cost)):
            return None  # shadow proposals of every request in the same steps: one draft batch
        return DraftQuery(request, tokens, max(count, 1)), count

    def _pays_back(self, acceptance: Acceptance, request: Request, most: int, decoding: int, drafter: Drafter,
                   length: int) -> bool:
        """Whether drafting pays for the drafter's catch-up on the request's tokens (a new
        request's whole prompt) over its next tokens (adaptive.py)."""
        catch_up = drafter.catch_up_cost(request.request_id, length)
        horizon = min(request.params.max_tokens - request.num_output_tokens, PAYBACK_HORIZON)
        return acceptance.pays_back(most, self.row_cost, decoding, drafter.token_cost, catch_up, horizon)

    def _could_pay(self, most: int, decoding: int, token_cost: float) -> bool:
        """Whether drafts that are always kept would pay in a step of ``decoding`` requests
        (in a big batch they may not: then a shadow proposal could not change a thing)."""
        return ALWAYS_KEPT.draft_length(most, self.row_cost, decoding, token_cost) > 0

    def _most_drafts(self, request: Request) -> int:
        """The most draft tokens the request may verify next step: its setting (or the
        engine's), within its max_tokens and the context; 0 when it is not decoding (a
        prompt still being prefilled, an embedding) or held by what drafts cannot follow
        yet: tokens to force."""
        params = request.params
        wanted = self.config.num_tokens if params.num_speculative_tokens is None else params.num_speculative_tokens
        if (wanted == 0 or request.pooling is not None or request.forced_token_ids
                or request.num_computed_tokens != request.num_tokens - 1):
            return 0
        # The step samples 1 + k tokens: no more than max_tokens and the context allow, and
        # while the request thinks on a budget, no further than the budget's end (the
        # tokens that close its thinking are then forced, not drafted).
        limits = [wanted, params.max_tokens - request.num_output_tokens - 1, self.max_model_len - request.num_tokens]
        if params.thinking_budget is not None and not request.thinking_closed:
            limits.append(params.thinking_budget - request.num_output_tokens - 1)
        return max(0, min(limits))
