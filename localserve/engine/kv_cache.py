"""The paged KV cache's bookkeeping: which request owns which blocks, in which tier.

Two pools of fixed-size blocks: the device pool the model reads, and an optional CPU
tier in host memory. The manager decides; ``BlockCopies`` lists the data moves it
decided, which the runner performs before the next forward.

Prefix caching: a full block is named by a hash of (its parent's hash, its token ids),
so equal names mean equal prefixes and equal K/V. Requests that share a prefix share
its blocks (reference counts). A freed block keeps its name and stays reusable until a
new allocation evicts it, least recently used first; an evicted named block spills to
the CPU tier when that has room and comes back from there on a later hit.

Ordering within one step (what makes the deferred copies safe): every device-to-CPU
copy runs before every CPU-to-device copy, then the forward. A CPU block read by a
CPU-to-device copy stays pinned until the step ends, so no device-to-CPU copy of the
same step can land in it; a device block being restored belongs to a running request,
so nothing evicts it before the copy.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..formats.spec import ModelSpec
from ..kernels import KVCache
from .request import Request


class BlockPool:
    """Block ids with reference counts and an LRU queue of the free ones.

    A free block may still hold a named (hashed) prefix; it is reused on a hit and
    evicted only when an allocation needs it, oldest first. Free blocks without a
    name are handed out before any named one.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # first out first
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take (free ones, named or not)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def allocate(self, count: int) -> tuple[list[int], list[tuple[int, bytes]]]:
        """``count`` blocks at reference count one, and the named blocks evicted to get
        them as ``(block, hash)`` (their data is intact until the caller overwrites it)."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free)} free")
        blocks, evicted = [], []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            name = self._hash_of[block]
            if name is not None:
                evicted.append((block, name))
                self._forget(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks, evicted

    def touch(self, blocks: list[int]) -> None:
        """One more reference to each block (a free one leaves the free queue)."""
        for block in blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """One reference fewer each; at zero a named block joins the free queue as the
        most recently used, an unnamed one at the front (nothing worth keeping)."""
        for block in blocks:
            assert self._ref_counts[block] > 0, "freeing a free block"
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if self._hash_of[block] is None:
                    self._free.move_to_end(block, last=False)

    def lookup(self, name: bytes) -> int | None:
        return self._block_of.get(name)

    def register(self, block: int, name: bytes) -> None:
        """Name a block holding a full prefix; a name already held elsewhere stays there."""
        if name in self._block_of or self._hash_of[block] is not None:
            return
        self._hash_of[block] = name
        self._block_of[name] = block

    def _forget(self, block: int) -> None:
        name = self._hash_of[block]
        if name is not None:
            del self._block_of[name]
            self._hash_of[block] = None


def block_hash(parent: bytes | None, token_ids: list[int], images: bytes = b"") -> bytes:
    """The name of a full block: blake2b over the parent's name, the token ids and the
    hashes of the images whose tokens it holds. (A cryptographic hash: a collision would
    silently serve another prompt's K/V.)"""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    digest.update(images)
    return digest.digest()


@dataclass(slots=True)
class BlockCopies:
    """Data moves for one step, in the order they must run: device to CPU, then CPU to device."""

    to_cpu: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    to_device: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)

    def __bool__(self) -> bool:
        return bool(self.to_cpu or self.to_device)


@dataclass(slots=True)
class PrefixHit:
    """The longest cached prefix of a request: device blocks to share, then CPU blocks to
    copy back; ``num_tokens`` of its tokens need no computing."""

    device_blocks: list[int]
    cpu_blocks: list[int]
    num_tokens: int


@dataclass(slots=True)
class KVCacheStats:
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up at admission
    prefix_cache_hits: int = 0  # of those, tokens found cached (device or CPU tier)
    prefix_cache_cpu_hits: int = 0  # of the hits, tokens restored from the CPU tier


class KVCacheManager:
    """Grows block tables on demand, shares cached prefixes, swaps requests between tiers."""

    def __init__(self, device_pool: BlockPool, cpu_pool: BlockPool, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        self.device = device_pool
        self.cpu = cpu_pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = KVCacheStats()
        self._copies = BlockCopies()
        self._cpu_pinned_for_step: list[int] = []

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- device allocation ----------------------------------------------------------------

    def _allocate_device(self, count: int) -> list[int]:
        blocks, evicted = self.device.allocate(count)
        for block, name in evicted:
            self._spill(block, name)
        return blocks

    def _spill(self, device_block: int, name: bytes) -> None:
        """Keep an evicted prefix block in the CPU tier if it has room."""
        if self.cpu.num_free == 0 or self.cpu.lookup(name) is not None:
            return
        [cpu_block], _ = self.cpu.allocate(1)  # may evict an older spilled block: fine
        self._copies.to_cpu.append((device_block, cpu_block))
        self.cpu.register(cpu_block, name)
        self.cpu.free([cpu_block])  # held by nobody, named: reusable until evicted

    def try_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more cached tokens; False if the pool is short."""
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        if needed <= 0:
            return True
        if needed > self.device.num_free:
            return False
        request.block_table.extend(self._allocate_device(needed))
        return True

    def trim(self, request: Request) -> None:
        """Free the blocks past those the request's tokens need: where the K/V of draft
        tokens it did not accept went (never named: they hold no computed token)."""
        keep = self.blocks_for(request.num_tokens)
        if len(request.block_table) > keep:
            self.device.free(request.block_table[keep:][::-1])
            del request.block_table[keep:]

    # -- prefix caching -------------------------------------------------------------------

    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """Names of the request's first ``num_blocks`` full blocks (memoised on it)."""
        hashes = request.block_hashes
        size = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else None, request.token_ids[i * size:(i + 1) * size],
                                     request.image_key(i * size, (i + 1) * size)))
        return hashes[:num_blocks]

    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """The longest run of the request's full blocks cached on the device, continued
        from the CPU tier, within what it may reuse (``Request.reusable_prefix_tokens``)."""
        if not self.enable_prefix_caching:
            return PrefixHit([], [], 0)
        names = self._block_hashes(request, request.reusable_prefix_tokens // self.block_size)
        device_blocks: list[int] = []
        for name in names:
            block = self.device.lookup(name)
            if block is None:
                break
            device_blocks.append(block)
        cpu_blocks: list[int] = []
        for name in names[len(device_blocks):]:
            block = self.cpu.lookup(name)
            if block is None:
                break
            cpu_blocks.append(block)
        return PrefixHit(device_blocks, cpu_blocks, (len(device_blocks) + len(cpu_blocks)) * self.block_size)

    def admit(self, request: Request, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Give a waiting request its cached prefix and room for ``num_new_tokens`` after
        it; False (and nothing changed) if the device pool is short."""
        new_count = self.blocks_for(hit.num_tokens + num_new_tokens) - len(hit.device_blocks)
        # Cached blocks nobody holds sit in the free queue: using them takes them out.
        idle_hits = sum(1 for b in hit.device_blocks if self.device.ref_count(b) == 0)
        if new_count > self.device.num_free - idle_hits:
            return False
        self.device.touch(hit.device_blocks)
        self.cpu.touch(hit.cpu_blocks)  # pinned: nothing may land in them before they are read
        self._cpu_pinned_for_step.extend(hit.cpu_blocks)
        new_blocks = self._allocate_device(new_count)
        names = request.block_hashes[len(hit.device_blocks):len(hit.device_blocks) + len(hit.cpu_blocks)]
        for cpu_block, device_block, name in zip(hit.cpu_blocks, new_blocks, names):
            self._copies.to_device.append((cpu_block, device_block))
            self.device.register(device_block, name)
        request.block_table = hit.device_blocks + new_blocks
        request.num_computed_tokens = hit.num_tokens
        request.num_cached_blocks = len(hit.device_blocks) + len(hit.cpu_blocks)
        if self.enable_prefix_caching:
            self.stats.prefix_cache_queries += request.num_tokens
            self.stats.prefix_cache_hits += hit.num_tokens
            self.stats.prefix_cache_cpu_hits += len(hit.cpu_blocks) * self.block_size
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Name the request's blocks that filled up with computed tokens since last time."""
        if not self.enable_prefix_caching:
            return
        full = request.num_computed_tokens // self.block_size
        if full <= request.num_cached_blocks:
            return
        names = self._block_hashes(request, full)
        for i in range(request.num_cached_blocks, full):
            self.device.register(request.block_table[i], names[i])
        request.num_cached_blocks = full

    # -- the CPU tier -----------------------------------------------------------------------

    def can_swap_out(self, request: Request) -> bool:
        return 0 < len(request.block_table) <= self.cpu.num_free

    def swap_out(self, request: Request) -> None:
        """Copy the request's blocks to the CPU tier and release them on the device (named
        ones stay cached there)."""
        cpu_blocks, _ = self.cpu.allocate(len(request.block_table))
        self._copies.to_cpu.extend(zip(request.block_table, cpu_blocks))
        self.stats.swap_out_blocks += len(cpu_blocks)
        self.device.free(request.block_table[::-1])
        request.cpu_block_table = cpu_blocks
        request.block_table = []
        request.num_cached_blocks = 0

    def try_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Bring a swapped request back with room for ``num_new_tokens`` more; False if
        the device pool is short."""
        needed = max(self.blocks_for(request.num_computed_tokens + num_new_tokens), len(request.cpu_block_table))
        if needed > self.device.num_free:
            return False
        device_blocks = self._allocate_device(needed)
        self._copies.to_device.extend(zip(request.cpu_block_table, device_blocks))
        self.stats.swap_in_blocks += len(request.cpu_block_table)
        self._cpu_pinned_for_step.extend(request.cpu_block_table)  # freed once copied
        request.block_table = device_blocks
        request.cpu_block_table = []
        return True

    # -- release and step boundaries ----------------------------------------------------------

    def free(self, request: Request) -> None:
        """Release everything the request holds in either tier (last block first, so
        a prompt's tail is evicted before its head)."""
        self.device.free(request.block_table[::-1])
        self.cpu.free(request.cpu_block_table)
        request.block_table = []
        request.cpu_block_table = []
        request.num_cached_blocks = 0

    def take_copies(self) -> BlockCopies:
        copies, self._copies = self._copies, BlockCopies()
        return copies

    def end_step(self) -> None:
        """The step's copies are done: unpin the CPU blocks they read."""
        self.cpu.free(self._cpu_pinned_for_step)
        self._cpu_pinned_for_step = []


def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, with a cache of ``dtype`` (8-bit adds scales)."""
    return spec.num_layers * block_size * KVCache.bytes_per_token(spec.num_kv_heads, spec.head_dim, dtype)


def allocate_kv_tensors(
    spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
    pin_memory: bool = False,
) -> list[KVCache]:
    """One cache per layer, of ``num_blocks`` blocks."""
    return [KVCache.allocate(num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype, device, pin_memory)
            for _ in range(spec.num_layers)]
