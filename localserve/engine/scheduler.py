"""Iteration-level (continuous) batching under a per-step token budget.

Every step the running requests go first, oldest first: a decode costs one token of
budget (and one more per draft token it verifies, see engine/speculative/; drafts that do
not fit are dropped), a partly prefilled prompt takes the next chunk that fits. Then requests swapped
out to the CPU tier come back, oldest first, and only when none is left do waiting
requests join, first come first served, each starting after its cached prefix, while
budget, sequence slots and free blocks last; a long prompt joins with whatever chunk
of it fits. A chunk never splits an image whose tokens see each other (Gemma 3's): it
ends before the image, or takes it whole.

When a running request needs a block and none is free, the newest running request is
preempted: swapped out to the CPU tier when that has room for its blocks, otherwise
freed to be recomputed later. Nothing comes back or joins in a step that preempted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .config import EngineConfig
from .kv_cache import BlockCopies, KVCacheManager
from ..vision.encoder import ImageEncoder
from .request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per request, this step
    preempted: list[Request] = field(default_factory=list)
    copies: BlockCopies = field(default_factory=BlockCopies)  # to run before the forward

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(num_new_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        if config.max_num_batched_tokens is None:
            raise ValueError("the scheduler needs options resolved for a device (EngineConfig.for_device)")
        self.step_tokens = config.max_num_batched_tokens
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest admission first
        self.swapped: deque[Request] = deque()  # oldest admission first
        self.num_preemptions = 0
        self.num_recomputes = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.step_tokens)
        if not batch.preempted:  # a step that preempted has a full pool
            budget = self._swap_in(batch, budget)
            if not self.swapped:
                self._admit_waiting(batch, budget)
        batch.copies = self.kv.take_copies()
        return batch

    def _remaining(self, request: Request, budget: int) -> int:
        return _chunk(request, request.num_computed_tokens, budget)

    def _with_drafts(self, request: Request, budget: int) -> int:
        """The request's next tokens and, after them, the draft tokens the budget has room
        for (the rest are dropped from the request)."""
        num_new = self._remaining(request, budget)
        del request.draft_token_ids[budget - num_new:]
        return num_new + len(request.draft_token_ids)

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._with_drafts(request, budget)
            if request.draft_token_ids and not self.kv.try_allocate(request, num_new):
                request.draft_token_ids = []  # no room to verify drafts: decode plainly
                num_new = self._remaining(request, budget)
            while not self.kv.try_allocate(request, num_new):
                victim = self.running.pop()  # the newest
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is request:
                    return budget  # it preempted itself: nothing newer is left to run
            batch.add(request, num_new)
            budget -= num_new
            index += 1
        for request in self.running[index:]:
            request.draft_token_ids = []  # not in this step
        return budget

    def _swap_in(self, batch: ScheduledBatch, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            num_new = self._remaining(request, budget)
            if not self.kv.try_swap_in(request, num_new):
                break
            self.swapped.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.add(request, num_new)
            budget -= num_new
        return budget

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit = self.kv.find_cached_prefix(request)
            num_new = _chunk(request, hit.num_tokens, budget)
            if not self.kv.admit(request, hit, num_new):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:  # not again when it comes back to recompute
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            batch.add(request, num_new)
            budget -= num_new

    def _preempt(self, request: Request) -> None:
        """Swap the request out to the CPU tier if it has room, else free its blocks and
        queue it to be recomputed first."""
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.draft_token_ids = []
        if self.kv.can_swap_out(request):
            self.kv.swap_out(request)
            request.status = RequestStatus.SWAPPED
            self.swapped.appendleft(request)  # preempted newest first: the oldest ends up first
            return
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.num_recomputes += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Release a finished or aborted request wherever it is."""
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
                break
        self.kv.free(request)
        request.status = RequestStatus.FINISHED


def _chunk(request: Request, start: int, budget: int) -> int:
    """How many of the request's tokens from ``start`` this step computes: what the budget
    allows, kept from splitting an image whose tokens see each other (vision/encoder.py)."""
    num_new = min(request.num_tokens - start, budget)
    return ImageEncoder.fit_chunk(request.images, start, num_new) if request.images else num_new
