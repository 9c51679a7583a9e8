"""The membership record in the rendezvous store and the ``SegmentTable`` derived from it.

The whole membership of a pool is ONE value in the rendezvous store (``{ns}/table``),
a msgpack :class:`MembershipRecord`; joins, leaves and removals replace it with
compare-and-swap, so every change is atomic and totally ordered by ``version``.
:meth:`SegmentTable.derive` is a pure function of that record, so every process that
read the same record holds the same table and one GVA means the same byte everywhere.

Versions: ``version`` grows on every change; ``layout_version`` is the version at which
a stride last grew (every GVA of a rank > 0 moved then); each member's ``since`` is the
version at which that incarnation joined (a rank number can be reused after a leave).
An address computed under version ``v`` is still good for rank ``r`` iff
``since(r) <= v`` and ``layout_version <= v`` (:meth:`SegmentTable.check_version`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvfabric.errors import RankUnavailable, StaleSegmentTable
from kvfabric.platform.types import Medium
from kvfabric.pool.gva.address import (
    MEDIUM_REGION,
    REGION_MEDIUM,
    AddressSpace,
    Gva,
    decode,
    encode,
)


class WindowRecord(msgspec.Struct, frozen=True):
    """One window a member contributes: medium, size, IPC handle, owner's local address."""

    medium: str
    nbytes: int
    handle: bytes = b""
    addr: int = 0


class MemberRecord(msgspec.Struct, frozen=True):
    """One rank. ``token`` names this incarnation; ``routes`` holds transport descriptors
    (e.g. ``{"mooncake": "127.0.0.1:15001"}``)."""

    rank: int
    token: str
    node: str
    pid: int
    platform: str
    since: int = 0
    windows: tuple[WindowRecord, ...] = ()
    routes: dict[str, str] = msgspec.field(default_factory=dict)

    def window(self, medium: Medium) -> WindowRecord | None:
        for w in self.windows:
            if w.medium == medium.value:
                return w
        return None


class Reservation(msgspec.Struct, frozen=True):
    """A rank held for the incarnation that owned it before the pool's store restarted:
    only a joiner whose token hashes to ``digest`` takes it (``membership.token_digest``),
    and only until ``until`` (Unix time); ``node`` and ``pid`` name that owner in errors."""

    rank: int
    digest: str
    until: float
    node: str = ""
    pid: int = 0


class MembershipRecord(msgspec.Struct, frozen=True):
    version: int = 0
    layout_version: int = 0
    dram_stride: int = 0
    hbm_stride: int = 0
    members: tuple[MemberRecord, ...] = ()
    reserved: tuple[Reservation, ...] = ()  # ranks only their previous owner may take

    @property
    def space(self) -> AddressSpace:
        return AddressSpace(self.dram_stride, self.hbm_stride)

    def member(self, rank: int) -> MemberRecord | None:
        for m in self.members:
            if m.rank == rank:
                return m
        return None


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(MembershipRecord)


def encode_record(rec: MembershipRecord) -> bytes:
    return _ENC.encode(rec)


def decode_record(raw: bytes | None) -> MembershipRecord:
    if not raw:
        return MembershipRecord()
    try:
        return _DEC.decode(raw)
    except msgspec.DecodeError as e:
        raise ValueError(f"the membership record in the rendezvous store is corrupt: {e}") from e


@dataclass(frozen=True)
class Segment:
    """One window in the table: ``[base, base + nbytes)`` of the GVA space."""

    rank: int
    medium: Medium
    nbytes: int
    base: Gva
    member: MemberRecord
    window: WindowRecord

    @property
    def node(self) -> str:
        return self.member.node

    @property
    def since(self) -> int:
        return self.member.since


@dataclass(frozen=True)
class SegmentTable:
    """An immutable view of the pool's windows (see module docstring)."""

    version: int
    layout_version: int
    space: AddressSpace
    members: tuple[MemberRecord, ...]
    segments: tuple[Segment, ...]
    _index: dict[tuple[Medium, int], Segment] = field(default_factory=dict, repr=False, compare=False)
    _ranks: dict[int, MemberRecord] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def derive(cls, rec: MembershipRecord) -> SegmentTable:
        space = rec.space
        members = tuple(sorted(rec.members, key=lambda m: m.rank))
        segs = []
        for m in members:
            for w in sorted(m.windows, key=lambda w: MEDIUM_REGION[Medium(w.medium)]):
                med = Medium(w.medium)
                segs.append(Segment(m.rank, med, w.nbytes, encode(space, med, m.rank, 0), m, w))
        index = {(s.medium, s.rank): s for s in segs}
        return cls(
            rec.version, rec.layout_version, space, members, tuple(segs), index, {m.rank: m for m in members}
        )

    @classmethod
    def from_bytes(cls, raw: bytes | None) -> SegmentTable:
        return cls.derive(decode_record(raw))

    # ------------------------------------------------------------------ lookups
    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(m.rank for m in self.members)

    def member(self, rank: int) -> MemberRecord | None:
        return self._ranks.get(rank)

    def segment(self, medium: Medium, rank: int) -> Segment:
        s = self._index.get((medium, rank))
        if s is None:
            if rank in self._ranks:
                why = "it is a member that contributes none"
            else:
                why = "it is not a member: it never joined, left, or died and was removed"
            raise RankUnavailable(
                f"rank {rank} has no {medium.value} window in segment table v{self.version} ({why})"
            )
        return s

    def gva(self, medium: Medium, rank: int, offset: int = 0) -> Gva:
        """The GVA of ``offset`` in ``rank``'s ``medium`` window (checked against its size)."""
        seg = self.segment(medium, rank)
        if not 0 <= offset < seg.nbytes:
            raise ValueError(
                f"offset {offset} is outside rank {rank}'s {medium.value} window of {seg.nbytes} B"
            )
        return Gva(seg.base + offset)

    def locate(self, gva: int, nbytes: int, version: int | None = None) -> tuple[Segment, int]:
        """``(segment, offset)`` of ``[gva, gva + nbytes)``, which must lie in one window."""
        medium, rank, offset = decode(self.space, gva)
        seg = self.segment(medium, rank)
        if offset >= seg.nbytes:
            raise ValueError(
                f"GVA {int(gva):#x} is offset {offset} of rank {rank}'s {medium.value} window, "
                f"which has {seg.nbytes} B (outside the window)"
            )
        if offset + nbytes > seg.nbytes:
            raise ValueError(
                f"range {int(gva):#x}+{nbytes} crosses the end of rank {rank}'s {medium.value} window "
                f"({seg.nbytes} B, offset {offset})"
            )
        if version is not None:
            self.check_version(version, seg)
        return seg, offset

    def check_version(self, version: int, seg: Segment | None = None) -> None:
        """``StaleSegmentTable`` unless addresses computed at ``version`` are still good."""
        if version > self.version:
            raise StaleSegmentTable(
                f"address is from segment table v{version}, this process holds v{self.version}; "
                "wait for the newer table (Fabric.wait_for_version) and retry"
            )
        if self.layout_version > version:
            raise StaleSegmentTable(
                f"address is from segment table v{version}, but strides changed at v{self.layout_version}; "
                "recompute it from the current table"
            )
        if seg is not None and seg.since > version:
            raise StaleSegmentTable(
                f"address is from segment table v{version}, but rank {seg.rank} rejoined at v{seg.since}; "
                "its old addresses name memory that is gone"
            )

    def columns(self, region: int) -> tuple[np.ndarray, np.ndarray]:
        """``(sizes, since)`` int64 arrays indexed by rank for one medium region (0 = absent)."""
        medium = REGION_MEDIUM[region]
        n = max((s.rank for s in self.segments if s.medium is medium), default=-1) + 1
        sizes = np.zeros(n, np.int64)
        since = np.zeros(n, np.int64)
        for s in self.segments:
            if s.medium is medium:
                sizes[s.rank] = s.nbytes
                since[s.rank] = s.since
        return sizes, since

    def describe(self) -> str:
        rows = [
            f"segment table v{self.version} (layout v{self.layout_version}), {len(self.members)} member(s)"
        ]
        for m in self.members:
            wins = ", ".join(f"{w.medium} {w.nbytes} B" for w in m.windows) or "no window"
            rows.append(f"  rank {m.rank} pid {m.pid} on {m.node}: {wins}")
        return "\n".join(rows)
