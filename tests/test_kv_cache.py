"""Block pool, block manager and scheduler on their own (no model)."""

from __future__ import annotations

import pytest

from localserve import EngineConfig, SamplingParams
from localserve.engine.kv_cache import BlockPool, KVCacheManager
from localserve.engine.request import Request
from localserve.engine.scheduler import Scheduler


def make_request(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=8), frozenset())


def manager_with(device_blocks: int, cpu_blocks: int = 0, block_size: int = 16) -> KVCacheManager:
    return KVCacheManager(BlockPool(device_blocks), BlockPool(cpu_blocks), block_size)


def test_pool_reference_counts() -> None:
    pool = BlockPool(4)
    blocks, evicted = pool.allocate(3)
    assert pool.num_free == 1 and len(set(blocks)) == 3 and evicted == []
    pool.touch(blocks[:1])
    pool.free(blocks)
    assert pool.num_free == 3  # the shared block is still held once
    pool.free(blocks[:1])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_blocks_grow_on_demand() -> None:
    manager = manager_with(10)
    request = make_request("a", 20)
    assert manager.try_allocate(request, 20) and len(request.block_table) == 2
    request.num_computed_tokens = 20
    assert manager.try_allocate(request, 12) and len(request.block_table) == 2  # fits in slot 20..31
    request.num_computed_tokens = 32
    assert manager.try_allocate(request, 1) and len(request.block_table) == 3
    manager.free(request)
    assert request.block_table == [] and manager.device.num_free == 10


def test_scheduler_chunks_long_prompts_under_budget() -> None:
    config = EngineConfig(max_num_batched_tokens=32, max_num_seqs=4)
    scheduler = Scheduler(config, manager_with(100))
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
    scheduler = Scheduler(config, manager_with(2))
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


def test_pool_evicts_unnamed_first_then_least_recently_used() -> None:
    pool = BlockPool(4)
    blocks, _ = pool.allocate(4)
    for i, block in enumerate(blocks[:3]):
        pool.register(block, bytes([i]))
    pool.free([blocks[2], blocks[0], blocks[1], blocks[3]])  # named 2, 0, 1 in that order; 3 unnamed
    assert pool.num_free == 4 and pool.num_cached == 3
    taken, evicted = pool.allocate(2)
    assert taken == [blocks[3], blocks[2]] and evicted == [(blocks[2], bytes([2]))]
    assert pool.lookup(bytes([2])) is None and pool.lookup(bytes([0])) == blocks[0]
    pool.touch([blocks[0]])  # a hit takes a cached block out of the free queue
    assert pool.num_free == 1 and pool.ref_count(blocks[0]) == 1


def test_prefix_hit_leaves_the_last_token_to_compute() -> None:
    manager = manager_with(8)
    first = make_request("a", 32)  # exactly two full blocks
    assert manager.admit(first, manager.find_cached_prefix(first), 32)
    first.num_computed_tokens = 32
    manager.cache_full_blocks(first)
    twin = make_request("b", 32)
    hit = manager.find_cached_prefix(twin)
    assert hit.device_blocks == first.block_table[:1] and hit.num_tokens == 16  # not both blocks
    longer = make_request("c", 40)
    assert manager.find_cached_prefix(longer).device_blocks == first.block_table
    assert manager.admit(longer, manager.find_cached_prefix(longer), 8)
    assert longer.block_table[:2] == first.block_table and longer.num_computed_tokens == 32
    assert manager.device.ref_count(first.block_table[0]) == 2
    manager.free(first)
    manager.free(longer)
    assert manager.device.num_used == 0 and manager.device.num_cached == 2


def test_swap_out_and_in_record_copies_in_order() -> None:
    manager = manager_with(4, cpu_blocks=4)
    request = make_request("a", 40)
    assert manager.try_allocate(request, 40)
    device_blocks = list(request.block_table)
    request.num_computed_tokens = 40
    assert manager.can_swap_out(request)
    manager.swap_out(request)
    copies = manager.take_copies()
    assert [d for d, _ in copies.to_cpu] == device_blocks and copies.to_device == []
    assert manager.device.num_used == 0 and manager.cpu.num_used == 3
    cpu_blocks = list(request.cpu_block_table)
    assert [c for _, c in copies.to_cpu] == cpu_blocks
    assert manager.try_swap_in(request, 1)
    copies = manager.take_copies()
    assert copies.to_device == list(zip(cpu_blocks, request.block_table)) and copies.to_cpu == []
    assert manager.cpu.num_used == 3  # pinned until the step's copies have run
    manager.end_step()
    assert manager.cpu.num_used == 0 and len(request.block_table) == 3
