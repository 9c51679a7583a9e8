"""``SlotTable``: the index of the cache store's fixed slots.

Each slot holds one block shard. Per slot (numpy columns): the full 16-byte id and shard
index, a state (``FREE`` / ``FILLING`` / ``READY``: the ready flag; ``DEAD``: dropped after
failing verification, out of the index, freed when its last reader lets go), a reference
count (readers copying out of it), an LRU tick and the xxh3 digest its owner recorded
before publishing it (``digest``; written only while the slot is ``FILLING``). A dict
maps a 64-bit key folded from (id, shard) to the slot; every hit is verified against the
full id, so a key collision is a miss (or an uncacheable block), never wrong bytes.

Rules, all under one lock:

* Only ``READY`` slots are visible. A slot is claimed ``FILLING`` by one owner (a load
  that fills it from a lower store, or a dump that copies into it); others that want the
  same block wait for it to settle instead of filling it again (de-duplication).
* Replacement takes free slots first, then the least recently used ``READY`` slots with
  no references: a slot in use (referenced, or ``FILLING``) is never evicted.
* Each call works on whole arrays: O(1) Python work plus C-speed dict operations.
"""

from __future__ import annotations

import enum
import itertools
import threading
from dataclasses import dataclass

import numpy as np

FREE, FILLING, READY, DEAD = 0, 1, 2, 3

_MIX_HI = np.uint64(0x9E3779B97F4A7C15)
_MIX_SHARD = 0xD6E8FEB86659FD93


class Claim(enum.IntEnum):
    """What ``acquire`` / ``claim_write`` decided for a row."""

    HIT = 0  # READY and pinned (load) / already present (dump)
    OWN = 1  # claimed FILLING by this caller, which must publish it
    WAIT = 2  # FILLING by someone else: wait for it to settle, then ask again
    NONE = 3  # no slot (cache full of slots in use, or a key collision): bypass the cache


@dataclass(frozen=True)
class Claims:
    """Per-row decisions: ``slots`` (-1 for WAIT/NONE), ``kinds`` and ``first`` (the row is
    the first of its key in this call, so it is the one to fill or to copy in)."""

    slots: np.ndarray
    kinds: np.ndarray
    first: np.ndarray

    def rows(self, kind: Claim) -> np.ndarray:
        return np.flatnonzero(self.kinds == kind)


def keys_of(ids: np.ndarray, shard: int) -> np.ndarray:
    """64-bit keys folded from (id, shard); ``ids`` is a C-contiguous ``(n, 16)`` uint8 array."""
    w = ids.view("<u8").reshape(-1, 2)
    with np.errstate(over="ignore"):
        return w[:, 0] ^ (w[:, 1] * _MIX_HI) ^ np.uint64((shard * _MIX_SHARD) & 0xFFFFFFFFFFFFFFFF)


class SlotTable:
    """See module docstring. ``slots``: how many slots the cache has."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a cache needs at least one slot, got {slots}")
        self.size = slots
        self.ids = np.zeros((slots, 16), np.uint8)
        self.shard = np.zeros(slots, np.int32)
        self.state = np.zeros(slots, np.int8)
        self.refs = np.zeros(slots, np.int32)
        self.tick = np.zeros(slots, np.int64)
        self.keys = np.zeros(slots, np.uint64)
        self.digest = np.zeros(slots, np.uint64)
        self.index: dict[int, int] = {}
        self.free: list[int] = list(range(slots - 1, -1, -1))
        self.clock = 0
        self.lock = threading.Lock()
        self.settled = threading.Condition(self.lock)
        self.evictions = 0

    # ------------------------------------------------------------------ lookups (lock held)
    def _find(self, keys: np.ndarray, ids: np.ndarray, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """(slot or -1 when absent or another id, whether the key is taken by another id)."""
        n = keys.size
        slots = np.fromiter(map(self.index.get, keys.tolist(), itertools.repeat(-1)), np.int64, count=n)
        taken = np.zeros(n, bool)
        hit = np.flatnonzero(slots >= 0)
        if hit.size:
            s = slots[hit]
            same = (self.ids[s] == ids[hit]).all(axis=1) & (self.shard[s] == shard)
            bad = hit[~same]
            slots[bad] = -1
            taken[bad] = True
        return slots, taken

    def present(self, ids: np.ndarray, shards: int) -> np.ndarray:
        """Whether every shard ``0..shards-1`` of each id is READY."""
        out = np.ones(ids.shape[0], bool)
        with self.lock:
            for shard in range(shards):
                slots, _ = self._find(keys_of(ids, shard), ids, shard)
                ok = slots >= 0
                ok[ok] = self.state[slots[ok]] == READY
                out &= ok
        return out

    # ------------------------------------------------------------------ claims (lock held)
    def _take(self, k: int) -> np.ndarray:
        """Up to ``k`` slots: free ones first, then the least recently used idle READY ones."""
        got = [self.free.pop() for _ in range(min(k, len(self.free)))]
        need = k - len(got)
        if need > 0:
            idle = np.flatnonzero((self.state == READY) & (self.refs == 0))
            if idle.size > need:
                idle = idle[np.argpartition(self.tick[idle], need - 1)[:need]]
            if idle.size:
                list(map(self.index.pop, self.keys[idle].tolist()))
                self.state[idle] = FREE
                self.evictions += int(idle.size)
                got.extend(idle.tolist())
        return np.array(got, np.int64)

    def _claim(self, keys: np.ndarray, ids: np.ndarray, shard: int, pin: bool, claim: bool) -> Claims:
        n = keys.size
        _, first_idx, inv = np.unique(keys, return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
        first = np.zeros(n, bool)
        first[first_idx] = True
        slots, taken = self._find(keys, ids, shard)
        kinds = np.full(n, int(Claim.NONE), np.int8)
        found = slots >= 0
        state = np.where(found, self.state[np.where(found, slots, 0)], FREE)
        kinds[found & (state == READY)] = Claim.HIT
        kinds[found & (state == FILLING)] = Claim.WAIT
        slots[found & (state == FILLING)] = -1
        hits = slots[kinds == Claim.HIT]
        np.add.at(self.refs, hits, 1)  # pinned before taking slots: a hit is never the victim
        if claim:
            want = first & ~found & ~taken
            rows = np.flatnonzero(want)
            got = self._take(rows.size)
            rows = rows[: got.size]
            if rows.size:
                self.ids[got] = ids[rows]
                self.shard[got] = shard
                self.state[got] = FILLING
                self.keys[got] = keys[rows]
                self.index.update(zip(keys[rows].tolist(), got.tolist()))
                slots[rows] = got
                kinds[rows] = Claim.OWN
            # later rows of a key the first row now owns follow it
            own_first = np.full(first_idx.size, -1, np.int64)
            own_first[np.searchsorted(keys[first_idx], keys[rows])] = slots[rows]
            dup = ~first & (own_first[inv] >= 0)
            slots[dup] = own_first[inv][dup]
            kinds[dup] = Claim.OWN
        self.clock += 1
        self.tick[slots[(kinds == Claim.HIT) | (kinds == Claim.OWN)]] = self.clock
        if pin:
            np.add.at(self.refs, slots[kinds == Claim.OWN], 1)
        else:
            np.subtract.at(self.refs, hits, 1)
        return Claims(slots, kinds, first)

    def acquire(self, keys: np.ndarray, ids: np.ndarray, shard: int, claim: bool) -> Claims:
        """For a load: pin READY rows (HIT), claim absent ones (OWN, pinned) when ``claim``."""
        with self.lock:
            return self._claim(keys, ids, shard, pin=True, claim=claim)

    def claim_write(self, keys: np.ndarray, ids: np.ndarray, shard: int) -> Claims:
        """For a dump: HIT = already present, OWN = claimed for this writer (not pinned)."""
        with self.lock:
            return self._claim(keys, ids, shard, pin=False, claim=True)

    # ------------------------------------------------------------------ settle
    def publish(self, slots: np.ndarray, ok: np.ndarray, pinned: np.ndarray | None = None) -> None:
        """Owner's verdict on its FILLING ``slots`` (unique): READY where ``ok``, else freed.
        ``pinned``: the rows' slots the owner pinned (with repeats); the pins of failed slots
        are dropped here, so the owner releases only the ones that became READY."""
        slots = np.asarray(slots, np.int64)
        ok = np.asarray(ok, bool)
        with self.lock:
            self.state[slots[ok]] = READY
            bad = slots[~ok]
            if bad.size:
                if pinned is not None:
                    drop = pinned[np.isin(pinned, bad)]
                    np.subtract.at(self.refs, drop, 1)
                list(map(self.index.pop, self.keys[bad].tolist()))
                self.state[bad] = FREE
                self.free.extend(bad.tolist())
            self.settled.notify_all()

    def release(self, slots: np.ndarray) -> None:
        """Drop one pin per entry of ``slots`` (repeats allowed); a ``DEAD`` slot whose last
        pin this was becomes free."""
        if slots.size:
            with self.lock:
                np.subtract.at(self.refs, slots, 1)
                u = np.unique(slots)
                gone = u[(self.state[u] == DEAD) & (self.refs[u] == 0)]
                if gone.size:
                    self.state[gone] = FREE
                    self.free.extend(gone.tolist())

    def discard(self, slots: np.ndarray) -> None:
        """Take READY ``slots`` (pinned by the caller, who still releases them) out of the
        index: no later lookup finds them, and each is freed when its last pin goes."""
        with self.lock:
            u = np.unique(np.asarray(slots, np.int64))
            u = u[self.state[u] == READY]
            for slot, key in zip(u.tolist(), self.keys[u].tolist()):
                if self.index.get(key) == slot:
                    del self.index[key]
            self.state[u] = DEAD

    def wait_settled(self, keys: np.ndarray, ids: np.ndarray, shard: int, timeout: float) -> bool:
        """Wait up to ``timeout`` s until none of these is FILLING; True when settled."""
        with self.lock:

            def settled() -> bool:
                slots, _ = self._find(keys, ids, shard)
                found = slots >= 0
                return not (self.state[slots[found]] == FILLING).any()

            return self.settled.wait_for(settled, timeout)

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {
                "slots": self.size,
                "slots_ready": int((self.state == READY).sum()),
                "slots_filling": int((self.state == FILLING).sum()),
                "slots_pinned": int((self.refs > 0).sum()),
                "evictions": self.evictions,
            }
