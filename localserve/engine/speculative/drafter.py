"""What a drafter is to the speculator: asked each step for every drafting request's tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from ..request import Request


@dataclass(slots=True)
class DraftQuery:
    """A request's ask for up to ``count`` tokens to follow ``tokens`` (its token ids so far)."""

    request: Request
    tokens: np.ndarray
    count: int


class Drafter(Protocol):
    # A draft token's cost, as a share of one decode step of the served model (the
    # adaptive length weighs it): 0 for prompt lookup, a draft model's share of the weights.
    token_cost: float

    def propose_all(self, queries: list[DraftQuery]) -> list[list[int]]:
        """Each query's draft tokens (up to its count), the same every time it is asked the
        same. Called every step, with the requests drafting that step."""
        ...

    def release(self, request_id: str) -> None:
        """The request is done (finished or cancelled): what is kept for it goes."""
        ...

    def catch_up_cost(self, request_id: str, length: int) -> float:
        """What taking in the request's tokens (``length`` so far) that it lacks costs the
        drafter before its next proposal, in rows of a served decode step (a draft model's
        catch-up: the tokens times its layers' share of the weights; 0 for a drafter that
        keeps nothing)."""
        ...


class PerRequestDrafter:
    """A drafter that needs nothing but each request's tokens: proposes for one request
    at a time (``propose``), keeps nothing, costs nothing to run."""

    token_cost = 0.0

    def propose_all(self, queries: list[DraftQuery]) -> list[list[int]]:
        return [self.propose(query.request, query.tokens, query.count) for query in queries]

    def propose(self, request: Request, tokens: np.ndarray, count: int) -> list[int]:
        raise NotImplementedError

    def release(self, request_id: str) -> None:
        pass

    def catch_up_cost(self, request_id: str, length: int) -> float:
        return 0.0
