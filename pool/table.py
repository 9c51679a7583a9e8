"""``DirectoryTable``: the pool directory as a table in shared memory.

The meta service is the table's only writer; every client process on the node maps it
and looks keys up with no RPC. Layout (one shared-memory segment):

* a 128-byte header (``HDR``): magic, layout version, slot count, ``struct_seq``,
  object count, key-arena size and use, service epoch;
* ``nslots`` 64-byte slots (``SLOT``), open addressing with linear probing on a 64-bit
  key hash modulo ``nslots`` (0 marks an empty slot); each slot carries its own
  sequence counter ``seq``;
* a key arena holding the UTF-8 key bytes that slots point into.

Write protocol (service only, one thread): a slot is changed between ``seq`` going odd
and going even again; moving slots (backward-shift delete) or compacting the arena
happens between ``struct_seq`` going odd and even. Read protocol (any process, in C:
``_table.c``): a lookup retries while either counter is odd or changed under it, so it
sees a slot either before or after a write, never half of one. A reader that copies an
object's bytes re-checks the slot's ``seq`` afterwards (``seq_now``): a different value
means the object was removed or its space reused meanwhile, so the copy is discarded.

Readers write one field, ``atime`` (recency, a hint outside the seqlock).
Memory: the service owns the segment (``create``); clients ``attach`` it.
"""

from __future__ import annotations

import enum
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvfabric.errors import OutOfSpace
from kvfabric.platform import cbuild, shm

MAGIC = 0x3130_4C42_5446_564B  # "KVFTBL01"
LAYOUT = 2  # 2: slots carry the writer's checksum (csum); key offsets are 32-bit
OUT = 7  # fields a lookup reports per key: seq, gva, size, gen, state, expire, csum
HDR_BYTES = 128
HDR = np.dtype(
    [
        ("magic", "<u8"),
        ("layout", "<u8"),
        ("nslots", "<u8"),
        ("struct_seq", "<u8"),
        ("count", "<u8"),
        ("arena_size", "<u8"),
        ("arena_used", "<u8"),
        ("epoch", "<u8"),
        ("retired", "<u8"),  # 1 once a restarted service has replaced this table
        # on-node reads, counted by the clients that serve them from this table (atomic adds):
        ("local_keys", "<u8"),  # keys asked of the table by reads (get / batch get)
        ("local_hits", "<u8"),  # of those, served from the node's memory
        ("local_hit_bytes", "<u8"),  # bytes they moved
        ("local_corrupt", "<u8"),  # reads refused by the checksum check (a miss)
        ("reserved", "<u8", (3,)),
    ]
)
#: the header's on-node read counters (``TableView.count_reads``, ``kvf_tbl_count_reads``)
LOCAL_READS = ("local_keys", "local_hits", "local_hit_bytes", "local_corrupt")
SLOT = np.dtype(
    [
        ("seq", "<u8"),
        ("hash", "<u8"),
        ("gva", "<u8"),
        ("size", "<u8"),
        ("gen", "<u8"),
        ("csum", "<u8"),
        ("key_off", "<u4"),
        ("atime", "<u4"),
        ("expire", "<u4"),
        ("key_len", "<u2"),
        ("state", "u1"),
        ("pad", "u1"),
    ]
)
assert HDR.itemsize == HDR_BYTES and SLOT.itemsize == 64

_SRC = (Path(__file__).with_name("_table.c")).read_text()
_CDEF = """
uint64_t kvf_key_hash(const uint8_t *key, uint64_t len);
int64_t kvf_tbl_lookup(uint64_t base, uint64_t h, const uint8_t *key, uint32_t klen, uint64_t *out);
uint64_t kvf_tbl_lookup_batch(uint64_t base, const uint8_t *keys, const uint64_t *offs,
                              const uint32_t *lens, uint64_t n, int64_t *idx, uint64_t *out);
uint64_t kvf_tbl_seq(uint64_t base, int64_t i);
void kvf_tbl_touch(uint64_t base, int64_t i, uint32_t now);
void kvf_seq_begin(uint64_t addr);
void kvf_seq_end(uint64_t addr);
void kvf_key_hash_batch(const uint8_t *keys, const uint64_t *offs, const uint32_t *lens, uint64_t n,
                        uint64_t *out);
void kvf_tbl_seq_batch(uint64_t base, const int64_t *idx, uint64_t n, uint64_t *out);
void kvf_tbl_touch_batch(uint64_t base, const int64_t *idx, uint64_t n, uint32_t now);
void kvf_tbl_count_reads(uint64_t base, uint64_t keys, uint64_t hits, uint64_t bytes, uint64_t corrupt);
int64_t kvf_tbl_insert(uint64_t base, uint64_t h, const uint8_t *key, uint32_t klen, uint64_t gva,
                       uint64_t size, uint64_t gen, uint32_t state, uint32_t now, uint32_t expire);
void kvf_tbl_set_state(uint64_t base, int64_t i, uint32_t state, uint32_t now, uint32_t expire,
                       uint64_t csum);
"""

MISS, BUSY, RETIRED = -1, -2, -3


class TableRetired(Exception):
    """The table was retired by a restarted meta service: fetch the new one (``Info``)."""


class SlotState(enum.IntEnum):
    """Object states as the table shows them. Only READABLE objects are ever served."""

    EMPTY = 0
    ALLOCATED = 1
    READABLE = 2
    REMOVING = 3
    REPLICA = 4  # a further extent of a READABLE object (``pool/service/replicas.py``)


def native() -> Any:
    """The compiled table helpers (``.ffi``, ``.lib``)."""
    return cbuild.load("_kvf_table", _SRC, _CDEF)


def now_ticks() -> int:
    """Recency clock shared by all processes of a node: CLOCK_MONOTONIC in 1/10 s."""
    return int(time.monotonic() * 10) & 0xFFFFFFFF


def ticks_passed(deadline: int) -> bool:
    """Whether the tick ``deadline`` (wrapping u32) is in the past."""
    return ((now_ticks() - deadline) & 0xFFFFFFFF) < 0x80000000


def pack_keys(keys: list[bytes]) -> tuple[bytes, np.ndarray, np.ndarray]:
    lens = np.fromiter((len(k) for k in keys), np.uint32, len(keys))
    offs = np.zeros(len(keys), np.uint64)
    if len(keys) > 1:
        np.cumsum(lens[:-1], out=offs[1:])
    return b"".join(keys), offs, lens


@dataclass(frozen=True)
class Hit:
    """A slot as one lookup saw it (``seq`` is what the after-copy check compares)."""

    slot: int
    seq: int
    gva: int
    size: int
    gen: int
    state: SlotState
    expire: int
    csum: int = 0  # the writer's checksum (``platform.checksum``); 0: none recorded


def table_bytes(nslots: int, arena: int) -> int:
    return HDR_BYTES + nslots * SLOT.itemsize + arena


class TableView:
    """A mapped table: the reader API (lookups run in C, no Python per probe)."""

    def __init__(self, seg: shm.Segment) -> None:
        self.seg = seg
        self.base = seg.ptr
        self.hdr = np.frombuffer(seg.array, HDR, 1, 0)
        if int(self.hdr["magic"][0]) != MAGIC or int(self.hdr["layout"][0]) != LAYOUT:
            raise ValueError(f"segment {seg.name} is not a kvfabric directory table of layout {LAYOUT}")
        self.nslots = int(self.hdr["nslots"][0])
        self.slots = np.frombuffer(seg.array, SLOT, self.nslots, HDR_BYTES)
        arena_at = HDR_BYTES + self.nslots * SLOT.itemsize
        self.arena = seg.array[arena_at : arena_at + int(self.hdr["arena_size"][0])]
        mod = native()
        self._ffi, self._lib = mod.ffi, mod.lib
        self._tls = threading.local()

    @property
    def epoch(self) -> int:
        return int(self.hdr["epoch"][0])

    @property
    def count(self) -> int:
        return int(self.hdr["count"][0])

    def lookup_raw(self, key: bytes) -> tuple[int, list[int]]:
        """Hot path: ``(slot, [seq, gva, size, gen, state, expire, csum])``; slot -1 on a miss."""
        tls = self._tls
        out = getattr(tls, "out", None)
        if out is None:
            out = tls.out = np.zeros(OUT, np.uint64)
            tls.ptr = self._ffi.cast("uint64_t *", out.ctypes.data)
        lib = self._lib
        i = lib.kvf_tbl_lookup(self.base, lib.kvf_key_hash(key, len(key)), key, len(key), tls.ptr)
        if i < MISS:
            if i == RETIRED:
                raise TableRetired(self.seg.name)
            raise TimeoutError("directory table stayed busy for the whole lookup")
        return i, out.tolist()

    def lookup(self, key: bytes) -> Hit | None:
        """The slot holding ``key`` (any state), or None. Raises TimeoutError if writers
        kept the slot busy for a long time (they never should)."""
        i, f = self.lookup_raw(key)
        if i == MISS:
            return None
        return Hit(i, f[0], f[1], f[2], f[3], SlotState(f[4]), f[5], f[6])

    def lookup_many(self, keys: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised lookup: ``(idx (n,) int64, fields (n, OUT) uint64)``; idx -1 = miss."""
        packed, offs, lens = pack_keys(keys)
        n = len(keys)
        idx = np.empty(n, np.int64)
        out = np.empty((n, OUT), np.uint64)
        ffi = self._ffi
        self._lib.kvf_tbl_lookup_batch(
            self.base,
            ffi.from_buffer("uint8_t[]", packed) if packed else ffi.NULL,
            ffi.cast("uint64_t *", offs.ctypes.data),
            ffi.cast("uint32_t *", lens.ctypes.data),
            n,
            ffi.cast("int64_t *", idx.ctypes.data),
            ffi.cast("uint64_t *", out.ctypes.data),
        )
        if (idx == RETIRED).any():
            raise TableRetired(self.seg.name)
        if (idx == BUSY).any():
            raise TimeoutError("directory table stayed busy for the whole lookup")
        return idx, out

    def seq_now(self, slot: int) -> int:
        return int(self._lib.kvf_tbl_seq(self.base, slot))

    def seq_many(self, idx: np.ndarray) -> np.ndarray:
        idx = np.ascontiguousarray(idx, np.int64)
        out = np.empty(idx.size, np.uint64)
        ffi = self._ffi
        self._lib.kvf_tbl_seq_batch(
            self.base, ffi.from_buffer("int64_t[]", idx), idx.size, ffi.from_buffer("uint64_t[]", out)
        )
        return out

    def touch_many(self, idx: np.ndarray) -> None:
        idx = np.ascontiguousarray(idx, np.int64)
        self._lib.kvf_tbl_touch_batch(
            self.base, self._ffi.from_buffer("int64_t[]", idx), idx.size, now_ticks()
        )

    def touch(self, slot: int, now: int | None = None) -> None:
        self._lib.kvf_tbl_touch(self.base, slot, now_ticks() if now is None else now)

    def retire(self) -> None:
        """Mark the table dead (a restarted service): readers stop trusting it."""
        self.hdr["retired"][0] = 1
        native().lib.kvf_seq_end(self.base + 3 * 8)  # a release store, ordering the flag first
        native().lib.kvf_seq_end(self.base + 3 * 8)

    @property
    def retired(self) -> bool:
        return bool(self.hdr["retired"][0])

    def count_reads(self, keys: int, hits: int = 0, hit_bytes: int = 0, corrupt: int = 0) -> None:
        """Add one read call's outcome to the table's on-node read counters (atomic adds in
        shared memory: every client process on the node counts into the same header, the
        service exports them). A client calls it once per read call, never per byte."""
        self._lib.kvf_tbl_count_reads(self.base, keys, hits, hit_bytes, corrupt)

    def local_reads(self) -> dict[str, int]:
        """The on-node read counters (see ``count_reads``)."""
        return {name: int(self.hdr[name][0]) for name in LOCAL_READS}

    def key_of(self, slot: int) -> bytes:
        s = self.slots[slot]
        off, n = int(s["key_off"]), int(s["key_len"])
        return bytes(self.arena[off : off + n])

    def readable_keys(self) -> tuple[np.ndarray, np.ndarray, bytes]:
        """A copy of what names the readable objects: ``(offsets, lengths, arena bytes)``,
        key ``i`` being ``arena[offsets[i] : offsets[i] + lengths[i]]``. Array copies
        only (no Python per key), so the service's writer may hold its lock around it for
        a large table and decode the keys after letting go."""
        live = self.slots[self.slots["state"] == SlotState.READABLE]
        used = int(self.hdr["arena_used"][0])
        return live["key_off"].astype(np.int64), live["key_len"].astype(np.int64), bytes(self.arena[:used])

    def close(self) -> None:
        self.slots = self.hdr = self.arena = None  # type: ignore[assignment]
        self.seg.close()


def attach(name: str, nbytes: int) -> TableView:
    """Map the service's table (clients)."""
    return TableView(shm.attach(name, nbytes))


def attach_any(name: str) -> TableView:
    """Map a table by segment name whatever its size (a restarted service reading the old one)."""
    path = os.path.join(shm.shm_dir(), name)
    return TableView(shm.attach(name, os.stat(path).st_size))


def create(
    max_objects: int, avg_key_bytes: int = 64, load_factor: float = 0.85, name: str | None = None
) -> TableView:
    """Create an empty table sized for ``max_objects`` (the service). ``name``: a
    persistent segment (``shm.open_named``) that survives a crash of the service."""
    if max_objects < 1:
        raise ValueError(f"max_objects must be >= 1, got {max_objects}")
    nslots = max(16, int(np.ceil(max_objects / load_factor)))
    arena = min(max(4096, max_objects * avg_key_bytes), 0xFFFF_FFFF)  # key offsets are 32-bit
    try:
        if name is None:
            seg = shm.create(table_bytes(nslots, arena))
        else:
            shm.unlink_named(name)
            seg, _ = shm.open_named(name, table_bytes(nslots, arena))
    except OutOfSpace as e:
        raise OutOfSpace(f"directory table for {max_objects} objects does not fit: {e}") from e
    hdr = np.frombuffer(seg.array, HDR, 1, 0)
    hdr["magic"], hdr["layout"], hdr["nslots"] = MAGIC, LAYOUT, nslots
    hdr["arena_size"] = arena
    hdr["epoch"] = int.from_bytes(os.urandom(8), "little") | 1
    return TableView(seg)
