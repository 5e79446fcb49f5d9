"""What the speculator keeps about one request."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .adaptive import Acceptance


class TokenHistory:
    """A request's token ids as a growing int64 array (amortized doubling)."""

    def __init__(self) -> None:
        self._buffer = np.empty(256, dtype=np.int64)
        self.length = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """The array of ``token_ids``, of which the first ``length`` are already held (a
        request's tokens only ever grow)."""
        new = len(token_ids)
        if new > self._buffer.shape[0]:
            grown = np.empty(max(new, 2 * self._buffer.shape[0]), dtype=np.int64)
            grown[: self.length] = self._buffer[: self.length]
            self._buffer = grown
        if new > self.length:
            self._buffer[self.length : new] = token_ids[self.length :]
        self.length = new
        return self._buffer[:new]


@dataclass(slots=True)
class RequestSpeculation:
    """What the speculator keeps about one request (on ``Request.speculation``)."""

    history: TokenHistory = field(default_factory=TokenHistory)
    acceptance: Acceptance = field(default_factory=Acceptance)
    # A proposal not verified (the request drafted none this step): (position, token),
    # checked against the token that came, so a request that stopped drafting learns
    # when drafting would pay again.
    shadow: tuple[int, int] | None = None
