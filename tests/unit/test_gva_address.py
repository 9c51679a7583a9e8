"""Pure parts of pool/gva: address encoding and window keys, the segment table, membership
updates, config."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfabric.errors import RankUnavailable, StaleSegmentTable
from kvfabric.platform.types import Medium
from kvfabric.pool.gva import membership
from kvfabric.pool.gva.address import (
    GVA_END,
    GVA_FLOOR,
    KEY_BITS,
    LOCAL_KEY,
    MAX_RANKS,
    MEDIUM_REGION,
    MIN_STRIDE,
    REGION_MEDIUM,
    REGION_SIZE,
    AddressSpace,
    base,
    decode,
    decode_many,
    encode,
    is_gva,
    key_rank,
    key_region,
    pack,
    pair_keys,
    region_of,
    unpack,
    window_key,
    window_keys,
)
from kvfabric.pool.gva.config import GvaConfig, PairRule
from kvfabric.pool.gva.rendezvous.base import Compacted
from kvfabric.pool.gva.rendezvous.state import StoreState
from kvfabric.pool.gva.segments import (
    MemberRecord,
    MembershipRecord,
    SegmentTable,
    WindowRecord,
    decode_record,
    encode_record,
)
from kvfabric.pool.windows import FixedStride

strides = st.integers(21, 44).map(lambda b: 1 << b)
media = st.sampled_from([Medium.DRAM, Medium.HBM])


@st.composite
def spaces_and_addresses(draw):
    space = AddressSpace(draw(strides), draw(strides))
    medium = draw(media)
    stride = space.stride(medium)
    rank = draw(st.integers(0, REGION_SIZE // stride - 1))
    offset = draw(st.integers(0, stride - 1))
    return space, medium, rank, offset


@given(spaces_and_addresses())
def test_encode_and_decode_invert_each_other(case):
    space, medium, rank, offset = case
    g = encode(space, medium, rank, offset)
    assert is_gva(g) and GVA_FLOOR <= g < GVA_END
    assert decode(space, g) == (medium, rank, offset)
    assert g == base(medium) + rank * space.stride(medium) + offset


@given(
    st.lists(spaces_and_addresses(), min_size=1, max_size=20),
    st.lists(st.integers(1, GVA_FLOOR - 1), max_size=5),
)
def test_decode_many_matches_decode(cases, locals_):
    space = cases[0][0]
    gvas = []
    for _, medium, rank, offset in cases:
        stride = space.stride(medium)
        gvas.append(encode(space, medium, rank % (REGION_SIZE // stride), offset % stride))
    arr = np.array(gvas + locals_, np.uint64)
    region, rank, off = decode_many(space, arr)
    for i, g in enumerate(gvas):
        med, r, o = decode(space, g)
        assert (region[i], rank[i], off[i]) == ({Medium.DRAM: 1, Medium.HBM: 2}[med], r, o)
    for j, v in enumerate(locals_):
        assert region[len(gvas) + j] == 0 and off[len(gvas) + j] == v


@given(st.one_of(st.integers(-(2**70), GVA_FLOOR - 1), st.integers(GVA_END, 2**70)))
def test_decode_rejects_what_is_not_a_gva(value):
    with pytest.raises(ValueError, match="not a global virtual address"):
        decode(AddressSpace(MIN_STRIDE, MIN_STRIDE), value)


@given(spaces_and_addresses(), st.integers(1, 2**45))
def test_encode_rejects_offsets_and_ranks_out_of_range(case, extra):
    space, medium, rank, _ = case
    stride = space.stride(medium)
    with pytest.raises(ValueError, match="outside the"):
        encode(space, medium, rank, stride + extra - 1)
    with pytest.raises(ValueError, match="outside"):
        encode(space, medium, REGION_SIZE // stride + extra, 0)
    with pytest.raises(ValueError, match="outside"):
        encode(space, medium, rank, -extra)


def test_regions_without_windows_and_bad_types():
    space = AddressSpace(MIN_STRIDE, 0)
    with pytest.raises(ValueError, match="no hbm window"):
        encode(space, Medium.HBM, 0, 0)
    with pytest.raises(ValueError, match="has no window"):
        decode(space, base(Medium.HBM))
    with pytest.raises(TypeError):
        decode(space, "0x10")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="power of two"):
        AddressSpace(3 << 20, 0)
    with pytest.raises(TypeError):
        AddressSpace(1.5, 0)  # type: ignore[arg-type]


@given(spaces_and_addresses())
def test_pack_and_unpack_are_the_raw_form_of_encode_and_decode(case):
    space, medium, rank, offset = case
    stride = space.stride(medium)
    g = pack(MEDIUM_REGION[medium], rank, offset, stride)
    assert g == encode(space, medium, rank, offset)
    assert unpack(g, stride) == (MEDIUM_REGION[medium], rank, offset)
    assert region_of(g) == MEDIUM_REGION[medium] and REGION_MEDIUM[region_of(g)] is medium
    assert pack(MEDIUM_REGION[medium], 0, 0, stride) == base(medium)


@given(st.integers(0, GVA_FLOOR - 1))
def test_local_addresses_are_in_region_zero(addr):
    assert region_of(addr) == 0 and not is_gva(addr)


@given(
    strides,
    st.lists(
        st.tuples(st.sampled_from([1, 2]), st.integers(0, 2**40), st.integers(0, 2**44)),
        min_size=1,
        max_size=50,
    ),
)
def test_pack_and_decode_many_agree_on_arrays(stride, items):
    space = AddressSpace(stride, stride)
    cases = [(reg, rank % (REGION_SIZE // stride), off % stride) for reg, rank, off in items]
    arr = np.array([pack(reg, rank, off, stride) for reg, rank, off in cases], np.uint64)
    region, rank, off = decode_many(space, arr)
    assert region.dtype == np.int64 and rank.dtype == np.int64 and off.dtype == np.uint64
    assert [(int(a), int(b), int(c)) for a, b, c in zip(region, rank, off)] == cases
    for g, want in zip(arr.tolist(), cases):
        assert unpack(g, stride) == want


def test_decode_many_marks_values_in_no_region():
    space = AddressSpace(MIN_STRIDE, MIN_STRIDE)
    arr = np.array([GVA_END, np.iinfo(np.uint64).max, 4096], np.uint64)
    region, rank, off = decode_many(space, arr)
    assert region.tolist() == [-1, -1, 0] and int(off[2]) == 4096 and int(rank[2]) == 0


@given(st.sampled_from([1, 2]), st.integers(0, MAX_RANKS - 1))
def test_window_keys_pack_region_and_rank(region, rank):
    key = window_key(region, rank)
    assert key != LOCAL_KEY and 0 < key < 1 << KEY_BITS
    assert (key_region(key), key_rank(key)) == (region, rank)


def test_window_keys_vectorised_and_pairs():
    ranks = np.array([0, 1, 7, MAX_RANKS - 1], np.int64)
    for region in (1, 2):
        keys = window_keys(region, ranks)
        assert keys.dtype == np.int64
        assert keys.tolist() == [window_key(region, int(r)) for r in ranks]
        assert (key_rank(keys) == ranks).all() and (key_region(keys) == region).all()
    assert (key_region(LOCAL_KEY), key_rank(LOCAL_KEY)) == (0, 0)
    every = np.array([LOCAL_KEY, *window_keys(1, ranks), *window_keys(2, ranks)], np.int64)
    src, dst = np.repeat(every, every.size), np.tile(every, every.size)
    pairs = pair_keys(src, dst)
    assert pairs.dtype == np.int64 and (pairs >= 0).all()
    assert np.unique(pairs).size == every.size**2  # distinct pairs, distinct ints
    assert ((pairs >> KEY_BITS) == src).all() and ((pairs & ((1 << KEY_BITS) - 1)) == dst).all()


@given(st.integers(12, 50).map(lambda b: 1 << b), media, st.data())
def test_fixed_stride_addressing_is_the_same_encoding(stride, medium, data):
    addr = FixedStride(stride)
    rank = data.draw(st.integers(0, REGION_SIZE // stride - 1))
    offset = data.draw(st.integers(0, stride - 1))
    g = addr.encode(medium, rank, offset)
    assert g == pack(MEDIUM_REGION[medium], rank, offset, stride)
    assert addr.decode(g) == (medium, rank, offset)
    with pytest.raises(ValueError, match="out of range"):
        addr.encode(medium, REGION_SIZE // stride, 0)
    with pytest.raises(ValueError, match="outside a"):
        addr.encode(medium, rank, stride)
    with pytest.raises(ValueError, match="not a global virtual address"):
        addr.decode(offset % GVA_FLOOR)


def test_only_address_py_knows_the_bit_layout():
    """No other pool module names the layout's constants, shifts by its widths or keeps its
    own table of region numbers."""
    import ast
    from pathlib import Path

    import kvfabric.pool

    root = Path(kvfabric.pool.__file__).resolve().parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "address.py" and path.parent.name == "gva":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.id if isinstance(node, ast.Name) else node.name if isinstance(node, ast.alias) else ""
            shift = (
                isinstance(node, ast.BinOp)
                and isinstance(node.op, (ast.LShift, ast.RShift))
                and isinstance(node.right, ast.Constant)
                and node.right.value in (24, 60)
            )
            media = isinstance(node, ast.Dict) and any(  # {Medium.DRAM: 1} or {1: Medium.DRAM}
                {type(k), type(v)} == {ast.Attribute, ast.Constant} and "Medium." in ast.unparse(node)
                for k, v in zip(node.keys, node.values)
            )
            if name.split(".")[-1] in {"REGION_BITS", "RANK_BITS", "KEY_BITS", "_MASK"} or shift or media:
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, f"GVA bit layout re-implemented outside pool/gva/address.py: {found}"


@given(st.integers(1, REGION_SIZE))
def test_stride_covers_the_window_and_is_a_power_of_two(n):
    s = AddressSpace.stride_for(n)
    assert s >= n and s >= MIN_STRIDE and s & (s - 1) == 0 and s < 2 * max(n, MIN_STRIDE)


def _member(rank: int, token: str, *wins: tuple[str, int], node: str = "n0") -> MemberRecord:
    return MemberRecord(
        rank, token, node, 100 + rank, "sim", 0, tuple(WindowRecord(m, n, b"h", 4096) for m, n in wins)
    )


def _grow(*members: MemberRecord) -> MembershipRecord:
    rec = MembershipRecord()
    for m in members:
        rec = membership.with_member(rec, m, None, AddressSpace())
    return rec


def test_table_is_derived_identically_from_the_record():
    rec = _grow(_member(0, "a", ("dram", 3 << 20)), _member(0, "b", ("dram", 1 << 20), ("hbm", 5 << 20)))
    raw = encode_record(rec)
    t1, t2 = SegmentTable.from_bytes(raw), SegmentTable.derive(decode_record(bytes(raw)))
    assert t1 == t2 and t1.version == 2 and t1.ranks == (0, 1)
    assert t1.space == AddressSpace(4 << 20, 8 << 20)  # largest window rounded up, not the local size
    seg = t1.segment(Medium.HBM, 1)
    assert seg.base == base(Medium.HBM) + (8 << 20) and seg.nbytes == 5 << 20
    assert t1.locate(seg.base + 10, 100) == (seg, 10)
    with pytest.raises(ValueError, match="crosses the end"):
        t1.locate(seg.base + (5 << 20) - 10, 100)
    with pytest.raises(ValueError, match="outside the window"):
        t1.locate(seg.base + (5 << 20) + 10, 1)
    with pytest.raises(RankUnavailable, match="contributes none"):
        t1.segment(Medium.HBM, 0)
    with pytest.raises(RankUnavailable, match="not a member"):
        t1.locate(encode(t1.space, Medium.DRAM, 7, 0), 1)


def test_versions_track_joins_leaves_and_stride_growth():
    rec = _grow(_member(0, "a", ("dram", 1 << 20)), _member(0, "b", ("dram", 1 << 20)))
    assert (rec.version, rec.layout_version) == (2, 0)
    assert [m.since for m in rec.members] == [1, 2]
    rec = membership.without(rec, "a")
    assert rec is not None and rec.version == 3 and membership.without(rec, "a") is None
    rec = membership.with_member(rec, _member(0, "c", ("dram", 1 << 20)), None, AddressSpace())
    assert rec.member(0).token == "c" and rec.member(0).since == 4  # lowest free rank is reused
    t = SegmentTable.derive(rec)
    with pytest.raises(StaleSegmentTable, match="rejoined"):
        t.check_version(3, t.segment(Medium.DRAM, 0))
    t.check_version(3, t.segment(Medium.DRAM, 1))  # rank 1 did not change
    with pytest.raises(StaleSegmentTable, match="holds v4"):
        t.check_version(9)
    rec = membership.with_member(rec, _member(0, "d", ("dram", 64 << 20)), None, AddressSpace())
    assert rec.layout_version == rec.version == 5 and rec.dram_stride == 64 << 20
    with pytest.raises(StaleSegmentTable, match="strides changed"):
        SegmentTable.derive(rec).check_version(4)
    with pytest.raises(ValueError, match="already held"):
        membership.with_member(rec, _member(0, "e"), 1, AddressSpace())


def test_config_validation_and_pair_rules():
    cfg = GvaConfig(transports=("mapped", "remote"), pair_rules=(PairRule(0, None, ("remote",)),))
    assert cfg.allowed(0, 3) == ("remote",) and cfg.allowed(2, 0) == ("mapped", "remote")
    for bad in (
        {"transports": ("carrier-pigeon",)},
        {"transports": ()},
        {"alignment": 3},
        {"namespace": "/"},
        {"copy_streams": 0},
        {"heartbeat_ttl": 0},
        {"dram_stride": -1},
    ):
        with pytest.raises(ValueError):
            GvaConfig(**bad)
    with pytest.raises(ValueError):
        PairRule(-1, None, ("mapped",))


def test_store_state_history_and_sessions():
    st_ = StoreState(history=16)
    st_.set("a", b"1", owner=7)
    st_.set("b", b"2", owner=None)
    assert st_.add("n", 3) == 3 and st_.append("l", b"xy") == 2
    assert st_.cas("a", b"0", b"9") == (False, b"1") and st_.cas("a", b"1", None) == (True, None)
    evs = st_.events_after("", 0)
    assert [e.key for e in evs] == ["a", "b", "n", "l", "a"] and evs[-1].value is None
    st_.set("e", b"x", owner=7)
    assert st_.drop_session(7) == 1 and st_.get("e") is None
    for i in range(40):
        st_.set(f"k{i}", b"v", owner=None)
    with pytest.raises(Compacted):
        st_.events_after("", 1)
    assert st_.events_after("k39", st_.rev - 1)[0].key == "k39"
