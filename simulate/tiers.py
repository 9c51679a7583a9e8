"""The simulated tiers: each an address range managed by the pool's own code.

Contract: a :class:`Tier` is one window of ``capacity`` bytes. Its space is an
:class:`~kvfabric.pool.service.allocator.ExtentAllocator` (or :class:`BlockSlots`, the
same answers as counters when every object is one block) and its eviction is the pool's
:class:`~kvfabric.pool.service.eviction.LruByBytes` between the cluster's watermarks, run
exactly as the meta service runs it: an insert that finds no free extent evicts for its
size, an insert that leaves the tier above the high watermark trims it to the low one,
victims least recently used first (recency = the simulated time of the last insert or
hit; blocks used at the same time go in the order they were used). Inserts are
put-if-absent (a present key is left as it is, recency included), as pool puts are.

A :class:`Node` holds one HBM tier per engine (vLLM's prefix cache, when the cluster
gives HBM), the node's pool DRAM and its SSD. Every insert and eviction is reported to an
optional :class:`KvIndex` (what a KV-event router learns): which nodes hold a key.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

import numpy as np

from kvfabric.pool.service.allocator import ExtentAllocator
from kvfabric.pool.service.eviction import LruByBytes
from kvfabric.simulate.config import ClusterConfig, TierName


class KvIndex:
    """Key -> the nodes holding it in any tier (an int for one node, a set for more)."""

    __slots__ = ("holders",)

    def __init__(self) -> None:
        self.holders: dict[Hashable, int | set[int]] = {}

    def stored(self, key: Hashable, node: int) -> None:
        h = self.holders.get(key)
        if h is None:
            self.holders[key] = node
        elif isinstance(h, int):
            if h != node:
                self.holders[key] = {h, node}
        else:
            h.add(node)

    def dropped(self, key: Hashable, node: int) -> None:
        h = self.holders.get(key)
        if h is None:
            return
        if isinstance(h, int):
            if h == node:
                del self.holders[key]
            return
        h.discard(node)
        if len(h) == 1:
            self.holders[key] = next(iter(h))

    def nodes(self, key: Hashable) -> int | set[int] | None:
        return self.holders.get(key)


class BlockSlots:
    """The space of a window that holds only blocks of one size (a multiple of ``align``):
    what :class:`ExtentAllocator` does in that case, as counters. Every extent is then a
    block at a multiple of the block size, so a block fits exactly when a slot is free, and
    with none free the largest free extent is the tail past the last whole slot; the
    eviction policy reads ``used``, ``largest_free`` and ``round`` and so decides the same
    for any ``need`` up to a block (the replay asks for one block or for 1 byte).
    ``kvfabric sim`` uses it unless the cluster sets ``exact_extents``; a test checks both
    give the same report."""

    __slots__ = ("_free", "_next", "align", "block", "capacity", "slots", "tail", "used")

    def __init__(self, capacity: int, block: int, align: int) -> None:
        if block % align:
            raise ValueError(f"block of {block} B is not a multiple of align {align}")
        self.capacity = capacity - capacity % align
        self.align = align
        self.block = block
        self.slots = self.capacity // block
        self.tail = self.capacity - self.slots * block
        self.used = 0
        self._free: list[int] = []
        self._next = 0

    def round(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align

    @property
    def largest_free(self) -> int:
        return self.block if self.used < self.slots * self.block else self.tail

    def alloc(self, nbytes: int) -> int | None:
        if self._free:
            off = self._free.pop()
        elif self._next < self.slots:
            off = self._next * self.block
            self._next += 1
        else:
            return None
        self.used += self.block
        return off

    def free(self, offset: int, nbytes: int) -> None:
        self._free.append(offset)
        self.used -= self.block


class Tier:
    """One window of ``capacity`` bytes of blocks of ``block_bytes`` (module docstring)."""

    __slots__ = (
        "alloc",
        "block_bytes",
        "capacity",
        "evicted",
        "node",
        "objects",
        "on_evict",
        "policy",
        "refused",
        "stored",
        "tier",
    )

    def __init__(
        self,
        tier: TierName,
        node: int,
        capacity: int,
        block_bytes: int,
        policy: LruByBytes,
        align: int,
        exact_extents: bool = False,
    ) -> None:
        self.tier = tier
        self.node = node
        self.capacity = capacity
        self.block_bytes = block_bytes
        self.alloc: ExtentAllocator | BlockSlots = (
            ExtentAllocator(capacity, align)
            if exact_extents or block_bytes % align
            else BlockSlots(capacity, block_bytes, align)
        )
        self.policy = policy
        #: key -> offset; dict order is the order of the last insert or hit, which is the
        #: order of simulated time (events run in time order), so a key's position in it
        #: is its recency stamp
        self.objects: dict[Hashable, int] = {}
        self.evicted = 0
        self.stored = 0
        self.refused = 0
        self.on_evict: Node | None = None

    def __contains__(self, key: Hashable) -> bool:
        return key in self.objects

    def __len__(self) -> int:
        return len(self.objects)

    def hit(self, key: Hashable, now: float) -> bool:
        """Whether ``key`` is here; a hit marks it most recently used."""
        off = self.objects.pop(key, None)
        if off is None:
            return False
        self.objects[key] = off
        return True

    def insert(self, key: Hashable, now: float) -> bool:
        """Put-if-absent one block; False when it fits nowhere even after eviction."""
        if key in self.objects:
            return True
        size = self.block_bytes
        off = self.alloc.alloc(size)
        if off is None:
            if self._evict(size):
                off = self.alloc.alloc(size)
            if off is None:
                self.refused += 1
                return False
        self.objects[key] = off
        self.stored += 1
        if self.policy.over_high(self.alloc.used, self.capacity):
            self._evict(1)
        return True

    def _evict(self, need: int) -> bool:
        objs = self.objects
        keys = list(objs)
        order = self.policy.order(np.arange(len(keys)))  # positions are the recency stamps
        victims: Iterator[Hashable] = (keys[i] for i in order.tolist())
        fits, freed = self.policy.evict(self.alloc, self.capacity, need, victims, self._free)
        self.evicted += freed
        return fits

    def _free(self, key: Hashable) -> bool:
        off = self.objects.pop(key, None)
        if off is None:
            return False
        self.alloc.free(off, self.block_bytes)
        if self.on_evict is not None:
            self.on_evict.dropped(key, self)
        return True


class Node:
    """One node's tiers: HBM per engine, DRAM, SSD (``None`` where the cluster gives 0)."""

    __slots__ = ("dram", "hbm", "index", "node", "ssd", "tiers")

    def __init__(self, node: int, cfg: ClusterConfig, index: KvIndex | None) -> None:
        pol = LruByBytes(cfg.high_watermark, cfg.low_watermark)
        bb = cfg.block_bytes

        def make(t: TierName, cap: int) -> Tier | None:
            return Tier(t, node, cap, bb, pol, cfg.align, cfg.exact_extents) if cap else None

        self.node = node
        self.index = index
        self.hbm: list[Tier | None] = [make(TierName.HBM, cfg.hbm_bytes) for _ in range(cfg.engines_per_node)]
        self.dram = make(TierName.DRAM, cfg.dram_bytes)
        self.ssd = make(TierName.SSD, cfg.ssd_bytes)
        self.tiers: list[Tier] = [t for t in (*self.hbm, self.dram, self.ssd) if t is not None]
        if index is not None:
            for t in self.tiers:
                t.on_evict = self

    def holds(self, key: Hashable) -> bool:
        return any(key in t.objects for t in self.tiers)

    def stored(self, key: Hashable) -> None:
        if self.index is not None:
            self.index.stored(key, self.node)

    def dropped(self, key: Hashable, tier: Tier) -> None:
        """``tier`` evicted ``key``: the index forgets this node once no tier holds it."""
        if self.index is not None and not self.holds(key):
            self.index.dropped(key, self.node)


__all__ = ["KvIndex", "Node", "Tier"]
