"""What the speculator keeps about one request."""

from __future__ import annotations

from dataclasses import dataclass, field

from .adaptive import Acceptance
from .ngram import TokenHistory


@dataclass(slots=True)
class RequestSpeculation:
    """What the speculator keeps about one request (on ``Request.speculation``)."""

    history: TokenHistory = field(default_factory=TokenHistory)
    acceptance: Acceptance = field(default_factory=Acceptance)
    # A proposal not verified (the request drafted none this step): (position, token),
    # checked against the token that came, so a request that stopped drafting learns
    # when drafting would pay again.
    shadow: tuple[int, int] | None = None
