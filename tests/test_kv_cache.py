"""Block pool, block manager and scheduler on their own (no model)."""

from __future__ import annotations

import pytest

from localserve import EngineConfig, SamplingParams
from localserve.engine.kv_cache import BlockManager, BlockPool
from localserve.engine.request import Request
from localserve.engine.scheduler import Scheduler


def make_request(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=8), frozenset())


def test_pool_reference_counts() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.num_free == 1 and len(set(blocks)) == 3
    pool.share(blocks[:1])
    pool.free(blocks)
    assert pool.num_free == 3  # the shared block is still held once
    pool.free(blocks[:1])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_blocks_grow_on_demand() -> None:
    manager = BlockManager(BlockPool(10), block_size=16)
    request = make_request("a", 20)
    assert manager.try_allocate(request, 20) and len(request.block_table) == 2
    request.num_computed_tokens = 20
    assert manager.try_allocate(request, 12) and len(request.block_table) == 2  # fits in slot 20..31
    request.num_computed_tokens = 32
    assert manager.try_allocate(request, 1) and len(request.block_table) == 3
    manager.free(request)
    assert request.block_table == [] and manager.pool.num_free == 10


def test_scheduler_chunks_long_prompts_under_budget() -> None:
    config = EngineConfig(max_num_batched_tokens=32, max_num_seqs=4)
    scheduler = Scheduler(config, BlockManager(BlockPool(100), 16))
    long, short = make_request("long", 70), make_request("short", 5)
    scheduler.add(long)
    scheduler.add(short)
    batch = scheduler.schedule()
    assert batch.requests == [long] and batch.num_new_tokens == [32]
    long.num_computed_tokens += 32
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [32] and batch.requests == [long]
    long.num_computed_tokens += 32
    batch = scheduler.schedule()  # the last 6 of the long prompt, and the short one joins
    assert batch.requests == [long, short] and batch.num_new_tokens == [6, 5]


def test_scheduler_preempts_newest_when_blocks_run_out() -> None:
    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4)
    scheduler = Scheduler(config, BlockManager(BlockPool(2), 16))
    old, new = make_request("old", 16), make_request("new", 16)
    scheduler.add(old)
    scheduler.add(new)
    batch = scheduler.schedule()
    assert batch.requests == [old, new]
    for r in (old, new):  # both prompts done, each sampled a token: each needs a 2nd block
        r.num_computed_tokens = 16
        r.token_ids.append(7)
    batch = scheduler.schedule()
    assert batch.requests == [old] and batch.preempted == [new]
    assert new.block_table == [] and new.num_computed_tokens == 0
    assert list(scheduler.waiting) == [new] and scheduler.num_preemptions == 1
