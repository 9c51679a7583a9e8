"""The sim platform's host copier: large copies split across threads, byte for byte."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvfabric.platform import native
from kvfabric.platform.sim import SimConfig, SimPlatform
from kvfabric.platform.sim.copier import HostCopier, default_threads, split
from kvfabric.platform.types import CopyBatch, Medium


def _pieces(rng, k, max_piece):
    sizes = rng.integers(0, max_piece, k).astype(np.uint64)
    src_off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
    order = rng.permutation(k)  # destinations in another order, still disjoint
    dst_off = np.zeros(k, np.uint64)
    dst_off[order] = np.concatenate([[0], np.cumsum(sizes[order])[:-1]]).astype(np.uint64)
    return sizes, src_off, dst_off


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_split_covers_every_byte_once_in_order(parts):
    rng = np.random.default_rng(parts)
    sizes, s_off, d_off = _pieces(rng, 50, 5000)
    base_s, base_d = np.uint64(1 << 20), np.uint64(1 << 30)
    cut = split(base_d + d_off, base_s + s_off, sizes, parts)
    assert len(cut) <= parts
    got_s = np.concatenate([np.arange(int(s), int(s + n)) for p in cut for s, n in zip(p[1], p[2])])
    want_s = np.concatenate([np.arange(int(base_s + s), int(base_s + s + n)) for s, n in zip(s_off, sizes)])
    assert np.array_equal(got_s, want_s)  # every source byte once, in order
    # each byte keeps its destination: piece i's byte j still goes to d_off[i] + j
    dst_of = {
        int(base_s + s + j): int(base_d + d + j)
        for s, d, n in zip(s_off, d_off, sizes)
        for j in range(int(n))
    }
    for d, s, n in cut:
        for dd, ss, nn in zip(d.astype(int), s.astype(int), n.astype(int)):
            assert dst_of[ss] == dd and dst_of[ss + nn - 1] == dd + nn - 1
    per_part = [int(p[2].sum()) for p in cut]
    assert max(per_part) - min(per_part) <= 1  # equal bytes, give or take one


def test_split_keeps_each_piece_mapping():
    sizes = np.array([10, 0, 7, 13], np.uint64)
    src = np.array([1000, 2000, 3000, 4000], np.uint64)
    dst = np.array([9000, 8000, 7000, 6000], np.uint64)
    cut = split(dst, src, sizes, 3)  # 30 bytes -> 10 each
    flat = [(int(d), int(s), int(n)) for p in cut for d, s, n in zip(*p)]
    assert flat == [(9000, 1000, 10), (7000, 3000, 7), (6000, 4000, 3), (6003, 4003, 10)]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_batch_moves_the_same_bytes_as_one_thread(threads):
    rng = np.random.default_rng(threads)
    sizes, s_off, d_off = _pieces(rng, 40, 64 << 10)
    total = int(sizes.sum())
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, np.uint8)
    c = HostCopier(native.get(), threads=threads, parallel_bytes=64 << 10)
    c.copy_batch(dst.ctypes.data + d_off, src.ctypes.data + s_off, sizes, total)
    for s, d, n in zip(s_off.astype(int), d_off.astype(int), sizes.astype(int)):
        assert np.array_equal(dst[d : d + n], src[s : s + n])


def test_copy_one_splits_disjoint_ranges_and_not_overlapping_ones():
    c = HostCopier(native.get(), threads=3, parallel_bytes=1 << 10)
    a = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    b = np.zeros_like(a)
    c.copy_one(b.ctypes.data, a.ctypes.data, a.nbytes)
    assert np.array_equal(a, b)
    ref = a.copy()
    c.copy_one(a.ctypes.data + 4096, a.ctypes.data, a.nbytes - 4096)  # overlapping: one memmove
    assert np.array_equal(a[4096:], ref[:-4096])


class _FailingNative:
    """Real copies, except that a part starting at ``bad`` raises after copying nothing."""

    def __init__(self, bad: int) -> None:
        self.real, self.bad, self.calls = native.get(), bad, 0

    def memcpy_batch(self, dst, src, n):
        self.calls += 1
        if int(src[0]) == self.bad:
            raise OSError("copy engine fault")
        self.real.memcpy_batch(dst, src, n)


def test_a_failed_part_is_raised_after_every_part_ended():
    a = np.ones(1 << 20, np.uint8)
    b = np.zeros_like(a)
    half = a.ctypes.data + (a.nbytes // 2)
    fake = _FailingNative(bad=half)
    c = HostCopier(fake, threads=2, parallel_bytes=1 << 10)  # type: ignore[arg-type]
    with pytest.raises(OSError, match="copy engine fault"):
        c.copy_one(b.ctypes.data, a.ctypes.data, a.nbytes)
    assert fake.calls == 2 and b[: a.nbytes // 2].all() and not b[a.nbytes // 2 :].any()


def test_config_and_environment(monkeypatch):
    monkeypatch.setenv("KVFABRIC_COPY_THREADS", "3")
    assert default_threads() == 3
    monkeypatch.setenv("KVFABRIC_COPY_THREADS", "auto")
    assert 1 <= default_threads() <= 4
    monkeypatch.setenv("KVFABRIC_COPY_THREADS", "0")
    with pytest.raises(ValueError, match="KVFABRIC_COPY_THREADS"):
        default_threads()
    with pytest.raises(ValueError, match="copy_threads"):
        SimConfig(copy_threads=0)
    with pytest.raises(ValueError, match="copy threads"):
        HostCopier(native.get(), threads=0)


def _host(ptr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))


def test_sim_platform_copies_large_batches_through_threads():
    plat = SimPlatform(config=SimConfig(copy_threads=2))
    try:
        n = 8 << 20
        src, dst = plat.alloc(n, Medium.DRAM), plat.alloc(n, Medium.HBM)
        data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
        _host(src.ptr, n)[:] = data
        plat.copy(dst, src, n)
        got = _host(dst.ptr, n)
        assert np.array_equal(got, data)
        half = n // 2
        plat.batch_copy(  # the halves swapped
            CopyBatch(
                np.array([dst.ptr + half, dst.ptr], np.uint64),
                np.array([src.ptr, src.ptr + half], np.uint64),
                np.array([half, half], np.uint64),
            )
        )
        assert np.array_equal(got[:half], data[half:]) and np.array_equal(got[half:], data[:half])
        plat.free(src), plat.free(dst)
    finally:
        plat.close()
