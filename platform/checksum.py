"""Checksums of memory ranges: what a writer seals and a reader verifies.

One digest, xxh3-64 (the ``xxhash`` library), over the bytes of one or more
host-addressable ranges taken in order, so an object written as many pieces and read
back into differently cut pieces digests the same. ``0`` is reserved for "no checksum
recorded" (a digest that happens to be 0 is stored as 1), so a zeroed header or slot
never passes as a sealed one.

Who uses it: the pool (a writer seals each object in its directory slot at commit; an
on-node or remote reader recomputes it over what it copied before the read counts) and
the stores (posix block files and cache slots carry their block's digest). ``Verify``
is the one setting that turns the reader's check on or off.

Memory: the functions read caller memory by address and keep no reference to it; the
caller guarantees the ranges are mapped and host-addressable for the duration of the call
(device memory must be staged to host first). Thread-safe: no shared state.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Iterable

import xxhash

NONE = 0  # "no checksum recorded"


class Verify(enum.Enum):
    """Whether readers check the writer's checksum before a read counts as a hit.

    ``ON``: every read is checked; a mismatch is a per-object / per-block failure (a miss for
    the caller, so vLLM recomputes). ``OFF``: writers still seal (so a later reader with
    ``ON`` can check), readers trust the bytes.
    """

    ON = "on"
    OFF = "off"

    @classmethod
    def parse(cls, value: object, what: str = "verify") -> Verify:
        if isinstance(value, Verify):
            return value
        if isinstance(value, bool):
            return cls.ON if value else cls.OFF
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ValueError(f"{what}={value!r}: expected one of {', '.join(v.value for v in cls)}") from None


def _seal(d: int) -> int:
    return d or 1


def view(ptr: int, nbytes: int) -> memoryview:
    """A memoryview of ``nbytes`` of host memory at ``ptr`` (no copy)."""
    if ptr <= 0 or nbytes < 0:
        raise ValueError(f"checksum of an impossible range: ptr={ptr:#x}, nbytes={nbytes}")
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


def digest_bytes(data: bytes | bytearray | memoryview) -> int:
    """The sealed digest of one in-memory value."""
    return _seal(xxhash.xxh3_64_intdigest(data))


def digest_ranges(ranges: Iterable[tuple[int, int]]) -> int:
    """The sealed digest of ``(ptr, nbytes)`` host ranges concatenated in order.

    One view spans all the ranges and each range is a slice of it (a view per range costs
    about 1.5 µs: 180 µs for a block of 122 pieces); the bytes between ranges are never
    read, so they need not be mapped."""
    rs = [(int(p), int(n)) for p, n in ranges if n]
    if len(rs) == 1:
        return digest_range(*rs[0])
    h = xxhash.xxh3_64()
    if rs:
        lo = min(p for p, _ in rs)
        whole = view(lo, max(p + n for p, n in rs) - lo)
        for p, n in rs:
            h.update(whole[p - lo : p - lo + n])
    return _seal(h.intdigest())


def digest_range(ptr: int, nbytes: int) -> int:
    """The sealed digest of one host range."""
    return _seal(xxhash.xxh3_64_intdigest(view(int(ptr), int(nbytes))))


def digest_views(views: Iterable[bytes | bytearray | memoryview]) -> int:
    """The sealed digest of buffers concatenated in order: :func:`digest_ranges` for callers
    that already hold views of the memory (a reader's ``preadv`` buffers), without building
    a view per range again (about 2 µs each: 100 µs for a block of 56 pieces)."""
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return _seal(h.intdigest())


__all__ = ["NONE", "Verify", "digest_bytes", "digest_range", "digest_ranges", "digest_views", "view"]
