"""Iteration-level (continuous) batching under a per-step token budget.

Every step the running requests go first, oldest first: a decode costs one token of
budget, a partly prefilled prompt takes the next chunk that fits. Waiting requests
then join, first come first served, while budget, sequence slots and free blocks
last; a long prompt joins with whatever chunk of it fits. When a running request
needs a block and none is free, the newest running request is preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .config import EngineConfig
from .kv_cache import BlockManager
from .request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per request, this step
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(num_new_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest admission first
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.blocks.try_allocate(request, num_new):
                victim = self.running.pop()  # the newest
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is request:
                    break
            else:
                batch.add(request, num_new)
                budget -= num_new
                index += 1
                continue
            break  # the request preempted itself: nothing newer is left to run

        # Nobody joins in a step that had to preempt: the pool is full.
        while self.waiting and budget > 0 and not batch.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.blocks.try_allocate(request, num_new):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.add(request, num_new)
            budget -= num_new
        return batch

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and queue it to be recomputed first.

        The seam for the CPU offload tier: swapping out instead of recomputing
        belongs here, chosen when the host pool has room.
        """
        self.blocks.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Release a finished or aborted request wherever it is."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request)
        request.status = RequestStatus.FINISHED
