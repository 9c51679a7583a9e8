"""Join, leave and removal as compare-and-swap updates of the membership record.

Keys of a pool with namespace ``ns`` in the rendezvous store:

* ``{ns}/m/table``: the :class:`MembershipRecord` (msgpack), replaced only by ``cas``.
* ``{ns}/m/alive/{token}``: an *ephemeral* key per member incarnation. It is written
  before the member enters the table and vanishes when the member's session ends, which
  is how the others learn that it died (``monitor.py`` then calls :func:`remove`).

Every update bumps ``version``; a join that widens a stride also sets ``layout_version``.
These functions are the only writers of the table.

Reserved ranks: a store that restarted (the pool daemon hosts it) starts empty, while
the objects of a rank with a window still carry that rank in their addresses. The
daemon therefore writes a :class:`Reservation` per such rank (:func:`reserve`): a join
that asks for no rank skips reserved ones, and only a joiner presenting the previous
owner's token (``Fabric.join(token=...)``) takes a reserved rank, which ends the
reservation. Reservations lapse at their ``until`` time.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence

from kvfabric.errors import ServiceUnavailable
from kvfabric.platform.types import Medium
from kvfabric.pool.gva.address import MAX_RANKS, AddressSpace
from kvfabric.pool.gva.rendezvous.base import KVStore
from kvfabric.pool.gva.segments import (
    MemberRecord,
    MembershipRecord,
    Reservation,
    decode_record,
    encode_record,
)

_MAX_RETRIES = 1000


def member_prefix(ns: str) -> str:
    """Everything the membership monitor watches."""
    return f"{ns}/m/"


def table_key(ns: str) -> str:
    return f"{ns}/m/table"


def alive_prefix(ns: str) -> str:
    return f"{ns}/m/alive/"


def alive_key(ns: str, token: str) -> str:
    return f"{ns}/m/alive/{token}"


def read(store: KVStore, ns: str) -> MembershipRecord:
    kv = store.try_get(table_key(ns))
    return decode_record(kv.value if kv else None)


def update(
    store: KVStore, ns: str, fn: Callable[[MembershipRecord], MembershipRecord | None]
) -> MembershipRecord:
    """Apply ``fn`` to the current record with compare-and-swap until it sticks.

    ``fn`` returns the new record, or None for "no change" (then the current one is
    returned). It may run several times and must have no side effects."""
    key = table_key(ns)
    kv = store.try_get(key)
    raw = kv.value if kv else None
    for _ in range(_MAX_RETRIES):
        cur = decode_record(raw)
        new = fn(cur)
        if new is None:
            return cur
        ok, now = store.cas(key, raw, encode_record(new))
        if ok:
            return new
        raw = now
    raise ServiceUnavailable(f"membership of {ns!r} changed {_MAX_RETRIES} times while updating it")


def token_digest(token: str) -> str:
    """What a reservation keeps of its owner's token (the token itself stays private)."""
    return hashlib.blake2b(token.encode(), digest_size=16).hexdigest()


def live_reservations(rec: MembershipRecord, now: float | None = None) -> dict[int, Reservation]:
    """The reservations of ``rec`` that have not lapsed, by rank."""
    t = time.time() if now is None else now
    return {r.rank: r for r in rec.reserved if r.until > t}


def lowest_free_rank(rec: MembershipRecord, now: float | None = None) -> int:
    """The lowest rank neither held by a member nor reserved for a previous owner."""
    taken = {m.rank for m in rec.members} | set(live_reservations(rec, now))
    r = 0
    while r in taken:
        r += 1
    return r


def with_member(
    rec: MembershipRecord,
    member: MemberRecord,
    rank: int | None,
    pinned: AddressSpace,
    now: float | None = None,
) -> MembershipRecord:
    """``rec`` plus ``member`` (at ``rank``, or the lowest free one), strides widened.

    A rank reserved for a previous owner goes only to a member whose token is that
    owner's; taking it ends the reservation."""
    reserved = live_reservations(rec, now)
    if rank is None:
        rank = lowest_free_rank(rec, now)
    elif (other := rec.member(rank)) is not None:
        raise ValueError(
            f"rank {rank} is already held by pid {other.pid} on {other.node} (token {other.token[:8]}); "
            "choose another rank, or wait until that one leaves or is removed"
        )
    elif (res := reserved.get(rank)) is not None and res.digest != token_digest(member.token):
        raise ValueError(
            f"rank {rank} is reserved for its owner before the pool restarted (pid {res.pid} on "
            f"{res.node}); only that owner's token reclaims it"
        )
    reserved.pop(rank, None)
    if rank >= MAX_RANKS:
        raise ValueError(f"rank {rank} is out of range (at most {MAX_RANKS} ranks)")
    space = AddressSpace(max(rec.dram_stride, pinned.dram_stride), max(rec.hbm_stride, pinned.hbm_stride))
    for w in member.windows:
        space = space.widened(Medium(w.medium), w.nbytes)
    for medium in (Medium.DRAM, Medium.HBM):
        if space.stride(medium) and rank >= space.max_ranks(medium):
            raise ValueError(
                f"rank {rank} does not fit the {medium.value} region at stride {space.stride(medium)}"
            )
    version = rec.version + 1
    layout = rec.layout_version
    changed = (space.dram_stride, space.hbm_stride) != (rec.dram_stride, rec.hbm_stride)
    # A stride that grows moves every GVA of existing ranks > 0 (only if there are any).
    if changed and any(m.rank > 0 and m.windows for m in rec.members):
        layout = version
    joined = MemberRecord(
        rank, member.token, member.node, member.pid, member.platform, version, member.windows, member.routes
    )
    members = tuple(sorted((*rec.members, joined), key=lambda m: m.rank))
    kept = tuple(sorted(reserved.values(), key=lambda r: r.rank))
    return MembershipRecord(version, layout, space.dram_stride, space.hbm_stride, members, kept)


def without(rec: MembershipRecord, token: str) -> MembershipRecord | None:
    """``rec`` without the member incarnation ``token`` (None if it is not there)."""
    if not any(m.token == token for m in rec.members):
        return None
    members = tuple(m for m in rec.members if m.token != token)
    return MembershipRecord(
        rec.version + 1, rec.layout_version, rec.dram_stride, rec.hbm_stride, members, rec.reserved
    )


def with_reservations(rec: MembershipRecord, add: Sequence[Reservation]) -> MembershipRecord | None:
    """``rec`` with ``add`` in force (replacing reservations of the same ranks); None if
    nothing changes. Reservations for ranks a member holds stay: they apply once it leaves."""
    if not add:
        return None
    merged = {r.rank: r for r in rec.reserved} | {r.rank: r for r in add}
    return MembershipRecord(
        rec.version + 1,
        rec.layout_version,
        rec.dram_stride,
        rec.hbm_stride,
        rec.members,
        tuple(sorted(merged.values(), key=lambda r: r.rank)),
    )


def reserve(store: KVStore, ns: str, reservations: Sequence[Reservation]) -> MembershipRecord:
    """Hold ``reservations``' ranks for their previous owners (see module docstring)."""
    return update(store, ns, lambda rec: with_reservations(rec, reservations))


def remove(store: KVStore, ns: str, token: str) -> MembershipRecord:
    """Take member incarnation ``token`` out of the table (idempotent)."""
    return update(store, ns, lambda rec: without(rec, token))
