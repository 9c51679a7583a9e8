import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfabric.errors import HandleError
from kvfabric.platform import handles
from kvfabric.platform.addrmap import AddressMap
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.types import BufferKind, CopyBatch, Direction, Medium


def test_medium_parse():
    assert Medium.parse("HBM") is Medium.HBM and Medium.parse(Medium.DRAM) is Medium.DRAM
    with pytest.raises(ValueError, match="unknown medium"):
        Medium.parse("vram")


def test_direction_matches_memcpy_kinds():
    assert Direction.of(Medium.DRAM, Medium.DRAM) == 0
    assert Direction.of(Medium.HBM, Medium.DRAM) is Direction.H2D == 1
    assert Direction.of(Medium.DRAM, Medium.HBM) is Direction.D2H == 2
    assert Direction.of(Medium.HBM, Medium.HBM) is Direction.D2D == 3


def test_copy_batch_from_items_validates():
    b = CopyBatch.from_items([(10, 20, 5), (30, 40, 6)])
    assert len(b) == 2 and b.total_bytes == 11 and b.dst.dtype == np.uint64
    with pytest.raises(TypeError, match="item 0"):
        CopyBatch.from_items([(1, 2)])
    with pytest.raises(ValueError, match="item 1: nbytes"):
        CopyBatch.from_items([(1, 2, 3), (1, 2, -3)])
    with pytest.raises(TypeError, match="src must be"):
        CopyBatch.from_items([(1, "x", 3)])
    with pytest.raises(ValueError, match="1-D"):
        CopyBatch(np.zeros((2, 2), int), np.zeros(4, int), np.zeros(4, int))


def test_handle_round_trip_and_refusals():
    h = handles.encode("sim", Medium.HBM, 4096, os.getpid(), 0, b"payload")
    rec = handles.decode(h, "sim")
    assert (rec.platform, rec.medium, rec.nbytes, rec.payload) == ("sim", "hbm", 4096, b"payload")
    with pytest.raises(HandleError, match="cuda"):
        handles.decode(h, "cuda")
    with pytest.raises(HandleError, match="not a kvfabric IPC handle"):
        handles.decode(h[:-3], "sim")
    with pytest.raises(HandleError, match="size"):
        handles.decode(handles.encode("sim", Medium.HBM, 0, 1, 0, b""), "sim")


class _P:  # the address map only needs buffers; a platform stand-in suffices
    name = "x"
    device = 0


def _buf(ptr, n, medium=Medium.DRAM):
    return Buffer(_P(), ptr, n, medium, device=0, kind=BufferKind.WRAPPED, shareable=False)


def test_address_map_refuses_overlap_and_finds_ranges():
    m = AddressMap()
    a, b = _buf(1000, 100), _buf(2000, 100, Medium.HBM)
    m.add(a)
    m.add(b)
    with pytest.raises(ValueError, match="overlaps"):
        m.add(_buf(1050, 10))
    with pytest.raises(ValueError, match="overlaps"):
        m.add(_buf(950, 60))
    assert m.find(1099, 1) == (a, 99)
    with pytest.raises(ValueError, match="not inside"):
        m.find(1099, 2)
    media = m.media_of(np.array([1000, 2050], np.uint64), np.array([10, 50], np.uint64), "src")
    assert media.tolist() == [0, 1]
    m.remove(a)
    with pytest.raises(ValueError, match="batch item 0: dst"):
        m.media_of(np.array([1000], np.uint64), np.array([1], np.uint64), "dst")


@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(1, 20)), min_size=1, max_size=30),
    st.lists(st.tuples(st.integers(0, 1500), st.integers(1, 40)), max_size=40),
)
def test_address_map_agrees_with_brute_force(spans, probes):
    m, live = AddressMap(), []
    for slot, n in spans:
        ptr = 1000 + slot * 25
        try:
            buf = _buf(ptr, n)
            m.add(buf)
            live.append(buf)
        except ValueError:
            assert any(b.ptr < ptr + n and ptr < b.end for b in live)
    for ptr, n in probes:
        inside = [b for b in live if b.ptr <= ptr and ptr + n <= b.end]
        if inside:
            assert m.find(ptr, n)[0] is inside[0]
        else:
            with pytest.raises(ValueError):
                m.find(ptr, n)
