"""Rank reservations in the membership record: a rank with a window survives a restart
of the pool's store for its owner's token only, whoever rejoins first."""

from __future__ import annotations

import pytest

from kvfabric.pool.gva import membership
from kvfabric.pool.gva.address import AddressSpace
from kvfabric.pool.gva.segments import (
    MemberRecord,
    MembershipRecord,
    Reservation,
    WindowRecord,
    decode_record,
    encode_record,
)

NOW = 1_000_000.0


def _member(token: str, window: int = 0) -> MemberRecord:
    wins = (WindowRecord("dram", window, b"h", 4096),) if window else ()
    return MemberRecord(-1, token, "n0", 4242, "sim", 0, wins)


def _restarted(*owners: tuple[int, str]) -> MembershipRecord:
    """A fresh record after a restart: rank 0 back, ``owners``' ranks reserved."""
    rec = membership.with_member(MembershipRecord(), _member("daemon", 1 << 20), 0, AddressSpace(), NOW)
    res = [Reservation(r, membership.token_digest(tok), NOW + 600, "n0", 77) for r, tok in owners]
    return membership.with_reservations(rec, res) or rec


def _join(rec: MembershipRecord, token: str, rank: int | None, now: float = NOW) -> MembershipRecord:
    return membership.with_member(rec, _member(token, 1 << 20), rank, AddressSpace(), now)


def test_a_client_asking_for_any_rank_skips_the_reserved_ones():
    rec = _restarted((1, "owner-a"), (2, "owner-b"))
    rec = _join(rec, "windowless", None)
    assert rec.member(3) is not None and rec.member(3).token == "windowless"
    assert [r.rank for r in rec.reserved] == [1, 2]  # still held for their owners


def test_only_the_owners_token_takes_a_reserved_rank_and_that_ends_the_reservation():
    rec = _restarted((1, "owner-a"))
    with pytest.raises(ValueError, match="rank 1 is reserved for its owner"):
        _join(rec, "someone-else", 1)
    rec = _join(rec, "owner-a", 1)
    assert rec.member(1).token == "owner-a" and rec.reserved == ()
    rec = membership.without(rec, "owner-a")
    assert rec is not None and membership.lowest_free_rank(rec, NOW) == 1  # free again after it left


def test_reservations_lapse_and_survive_the_record_encoding():
    rec = _restarted((1, "owner-a"))
    assert decode_record(encode_record(rec)) == rec
    later = NOW + 601
    assert membership.lowest_free_rank(rec, later) == 1
    rec = _join(rec, "someone-else", 1, now=later)
    assert rec.member(1).token == "someone-else" and rec.reserved == ()


def test_a_reservation_for_a_held_rank_applies_once_its_member_leaves():
    rec = _join(_restarted(), "owner-a", None)
    assert rec.member(1).token == "owner-a"
    new = membership.with_reservations(
        rec, [Reservation(1, membership.token_digest("owner-a"), NOW + 600, "n0", 1)]
    )
    assert new is not None and membership.with_reservations(new, []) is None
    rec = membership.without(new, "owner-a")
    assert rec is not None and membership.lowest_free_rank(rec, NOW) == 2
    assert _join(rec, "owner-a", 1).member(1).token == "owner-a"
