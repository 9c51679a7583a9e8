"""``TableWriter``: the meta service's write side of the directory table (``table.py``).

Single writer: every method must be called from one thread (the service loop) at a time.
Each change is bracketed by the slot's ``seq`` (content) or the header's ``struct_seq``
(slot moves, arena compaction) so lock-free readers in other processes never act on a
half-written slot. Deletion uses backward shifting, so the table has no tombstones and a
lookup stops at the first empty slot.
"""

from __future__ import annotations

import numpy as np

from kvfabric.errors import OutOfSpace
from kvfabric.pool.table import HDR_BYTES, SLOT, Hit, SlotState, TableView, now_ticks

_FIELDS = ("hash", "gva", "size", "gen", "csum", "key_off", "key_len", "atime", "expire", "state")
MAX_LOAD = 0.9


class TableWriter:
    """Mutations of a :class:`TableView` the service created (see module docstring)."""

    def __init__(self, view: TableView) -> None:
        self.view = view
        self.slots = view.slots
        self.n = view.nslots
        self._lib = view._lib
        self._hdr_addr = view.base
        self._struct_addr = view.base + 3 * 8  # HDR.struct_seq
        self._slot0 = view.base + HDR_BYTES

    # ------------------------------------------------------------------ helpers
    def _seq_addr(self, i: int) -> int:
        return self._slot0 + i * SLOT.itemsize

    def _hdr(self, field: str) -> int:
        return int(self.view.hdr[field][0])

    def _set_hdr(self, field: str, value: int) -> None:
        self.view.hdr[field] = value

    def hash_key(self, key: bytes) -> int:
        return int(self._lib.kvf_key_hash(key, len(key)))

    # ------------------------------------------------------------------ queries
    def find(self, key: bytes) -> Hit | None:
        return self.view.lookup(key)

    @property
    def count(self) -> int:
        return self._hdr("count")

    @property
    def capacity(self) -> int:
        return int(self.view.nslots * MAX_LOAD)

    # ------------------------------------------------------------------ inserts
    def insert(
        self, key: bytes, gva: int, size: int, gen: int, state: SlotState, expire: int = 0
    ) -> tuple[int, bool]:
        """Add ``key`` -> ``(slot, False)``; if present already, ``(its slot, True)`` and
        nothing changes. Raises ``OutOfSpace`` when the table or its key arena is full."""
        hit = self.find(key)
        if hit is not None:
            return hit.slot, True
        if self.count + 1 > self.capacity:
            raise OutOfSpace(f"directory table full: {self.count} objects (max {self.capacity})")
        if self._hdr("arena_used") + len(key) > self._hdr("arena_size"):
            self.compact_arena()
            if self._hdr("arena_used") + len(key) > self._hdr("arena_size"):
                raise OutOfSpace(f"directory key arena full ({self._hdr('arena_size')} B of keys)")
        i = int(
            self._lib.kvf_tbl_insert(
                self._hdr_addr,
                self.hash_key(key),
                key,
                len(key),
                gva,
                size,
                gen,
                int(state),
                now_ticks(),
                expire,
            )
        )
        if i < 0:
            raise OutOfSpace(f"directory key arena full ({self._hdr('arena_size')} B of keys)")
        return i, False

    def _write(self, i: int, **fields: int) -> None:
        addr = self._seq_addr(i)
        self._lib.kvf_seq_begin(addr)
        row = self.slots[i]
        for name, value in fields.items():
            row[name] = value
        self._lib.kvf_seq_end(addr)

    # ------------------------------------------------------------------ updates
    def set_state(self, slot: int, state: SlotState, expire: int = 0, csum: int = 0) -> None:
        """Publish a new state (with expiry and the writer's checksum), marking the slot as
        just used."""
        self._lib.kvf_tbl_set_state(self._hdr_addr, slot, int(state), now_ticks(), expire, csum)

    def update(self, slot: int, **fields: int) -> None:
        unknown = set(fields) - set(_FIELDS)
        if unknown:
            raise ValueError(f"unknown slot fields {sorted(unknown)}")
        self._write(slot, **fields)

    def remove(self, slot: int) -> None:
        """Delete the object in ``slot``: clear it and shift its cluster back."""
        lib, hashes = self._lib, self.slots["hash"]
        lib.kvf_seq_begin(self._struct_addr)
        try:
            i = slot
            self._clear(i)
            j = i
            while True:
                j = (j + 1) % self.n
                h = int(hashes[j])
                if h == 0:
                    break
                k = h % self.n
                stays = (i < k <= j) if i <= j else (k > i or k <= j)
                if stays:
                    continue
                row = self.slots[j]
                self._write(i, **{f: int(row[f]) for f in _FIELDS})
                self._clear(j)
                i = j
        finally:
            lib.kvf_seq_end(self._struct_addr)
        self._set_hdr("count", self.count - 1)

    def _clear(self, i: int) -> None:
        self._write(
            i,
            hash=0,
            gva=0,
            size=0,
            gen=0,
            csum=0,
            key_off=0,
            key_len=0,
            atime=0,
            expire=0,
            state=int(SlotState.EMPTY),
        )

    def compact_arena(self) -> None:
        """Rewrite the key arena with only live keys (readers retry meanwhile)."""
        live = np.flatnonzero(self.slots["hash"] != 0)
        offs = self.slots["key_off"][live].astype(np.int64)
        lens = self.slots["key_len"][live].astype(np.int64)
        arena = self.view.arena
        keys = [bytes(arena[o : o + n]) for o, n in zip(offs.tolist(), lens.tolist())]
        self._lib.kvf_seq_begin(self._struct_addr)
        try:
            pos = 0
            for slot, key in zip(live.tolist(), keys):
                arena[pos : pos + len(key)] = np.frombuffer(key, np.uint8)
                self.slots["key_off"][slot] = pos
                pos += len(key)
            self._set_hdr("arena_used", pos)
        finally:
            self._lib.kvf_seq_end(self._struct_addr)

    def set_epoch(self, epoch: int) -> None:
        self._set_hdr("epoch", epoch)
