"""Huge pages: large private sim buffers ask for transparent huge pages (as numpy's large arrays
do), and shared windows go on THP or hugetlb pages under the ``hugepages`` setting, checked
in ``/proc/PID/smaps`` of the owner and of another process that maps them.

Tests that need huge pages set the machine up as root (``shmem_enabled``, ``nr_hugepages``)
and put the old values back; without root they skip with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvfabric.errors import HandleError
from kvfabric.platform import hugepages as hp
from kvfabric.platform import shm
from kvfabric.platform.hugepages import HugePages, HugePagesUnavailable, PageKind
from kvfabric.platform.shm import HUGE_PAGE_BYTES
from kvfabric.platform.sim.backend import SimConfig, SimPlatform
from kvfabric.platform.types import Medium

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MiB = 1 << 20


smaps_of = hp.smaps_of


def _selected(path: Path) -> str:
    t = path.read_text()
    return t[t.index("[") + 1 : t.index("]")] if "[" in t else t.strip()


@contextmanager
def machine(shmem_enabled: str | None = None, nr_hugepages: int | None = None) -> Iterator[None]:
    """Set the huge page knobs for the block (root only) and always put the old values back."""
    if os.geteuid() != 0 or not os.access(hp.SHMEM_ENABLED, os.W_OK):
        pytest.skip("needs root to set shmem_enabled / nr_hugepages for the test")
    old_sh, old_nr = _selected(hp.SHMEM_ENABLED), hp.NR_HUGEPAGES.read_text().strip()
    try:
        if shmem_enabled is not None:
            hp.SHMEM_ENABLED.write_text(shmem_enabled)
        if nr_hugepages is not None:
            hp.NR_HUGEPAGES.write_text(str(nr_hugepages))
            got = int(hp.NR_HUGEPAGES.read_text())
            if got < nr_hugepages:
                pytest.skip(f"the kernel reserved {got} of {nr_hugepages} hugetlb pages (memory fragmented)")
        yield
    finally:
        hp.SHMEM_ENABLED.write_text(old_sh)
        hp.NR_HUGEPAGES.write_text(old_nr)


PEER = textwrap.dedent("""
    import json, sys
    from kvfabric.platform.sim.backend import SimPlatform
    from pathlib import Path
    sys.path.insert(0, sys.argv[3])
    from test_sim_huge_pages import smaps_of
    p = SimPlatform()
    b = p.import_handle(bytes.fromhex(sys.argv[1]))
    v = b.numpy()
    first = int(v[0]); v[int(sys.argv[2]) - 1] = 9
    print(json.dumps({"first": first, "smaps": smaps_of(b.ptr), "kind": b.impl.kind.value}))
    p.close()
""")


def peer_view(plat: SimPlatform, buf: object) -> dict:
    """Map ``buf`` in a fresh process: its first byte, its smaps, and it writes the last byte."""
    handle = plat.export_handle(buf).hex()  # type: ignore[arg-type]
    out = subprocess.run(
        [sys.executable, "-c", PEER, handle, str(buf.nbytes), str(Path(__file__).parent)],  # type: ignore[attr-defined]
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _kvf_fds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:kvf."):
            out.append(target)
    return out


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off here"
)
def test_large_private_buffers_are_huge_page_eligible_small_ones_untouched():
    plat = SimPlatform()
    try:
        big = plat.alloc(HUGE_PAGE_BYTES, Medium.DRAM)
        small = plat.alloc(64 << 10, Medium.HBM)
        flag = smaps_of(big.ptr).get("THPeligible")
        if flag is None:
            pytest.skip("this kernel does not report THPeligible in smaps")
        assert flag == "1"
        if "[madvise]" in THP.read_text():  # only the advice makes a mapping eligible
            assert smaps_of(small.ptr).get("THPeligible") == "0"
        big.numpy()[:] = 7  # the memory works as before
        assert int(big.numpy()[::4096].sum()) == 7 * (HUGE_PAGE_BYTES // 4096)
    finally:
        plat.close()


def test_setting_is_validated():
    assert SimConfig(hugepages="ON").hugepages is HugePages.ON
    assert SimConfig().hugepages is None
    with pytest.raises(ValueError, match="sim config hugepages='maybe'"):
        SimConfig(hugepages="maybe")


def test_without_huge_pages_auto_falls_back_to_4k_and_on_names_what_is_missing(isolated_shm):
    with machine(shmem_enabled="never", nr_hugepages=0):
        before = set(os.listdir(isolated_shm))
        auto = SimPlatform(config=SimConfig(hugepages="auto"))
        try:
            b = auto.alloc(8 * MiB, Medium.DRAM, shareable=True)
            assert b.impl.kind is PageKind.SMALL
            b.numpy()[:] = 1
            got = smaps_of(b.ptr)
            assert got["KernelPageSize"] == "4" and got["ShmemPmdMapped"] == "0", got
        finally:
            auto.close()
        for mode, words in [
            ("on", ["shmem_enabled is never", "0 free of 0 reserved", "nr_hugepages"]),
            ("thp", ["shmem_enabled is never"]),
            ("hugetlb", ["0 free of 0 reserved"]),
        ]:
            plat = SimPlatform(config=SimConfig(hugepages=mode))
            try:
                with pytest.raises(HugePagesUnavailable) as e:
                    plat.alloc(8 * MiB, Medium.DRAM, shareable=True)
                assert all(w in str(e.value) for w in words), str(e.value)
                with pytest.raises(HugePagesUnavailable, match="persistent segment"):
                    plat.alloc_named("hp-test", 8 * MiB)
                assert plat.owned_bytes == 0
            finally:
                plat.close()
        assert set(os.listdir(isolated_shm)) == before and not _kvf_fds()  # nothing left behind


def test_thp_window_is_pmd_mapped_in_owner_and_peer(isolated_shm):
    with machine(shmem_enabled="advise"):
        plat = SimPlatform(config=SimConfig(hugepages="on"))
        try:
            b = plat.alloc(5 * MiB, Medium.DRAM, shareable=True)  # rounded up to 6 MiB
            assert b.impl.kind is PageKind.THP and b.impl.mapped == 6 * MiB and b.nbytes == 5 * MiB
            b.numpy()[:] = 3
            mine = smaps_of(b.ptr)
            assert mine["THPeligible"] == "1"
            assert int(mine["ShmemPmdMapped"]) >= 4096, mine  # at least two 2 MiB pages
            peer = peer_view(plat, b)
            assert peer["first"] == 3 and peer["kind"] == "thp"
            assert int(peer["smaps"]["ShmemPmdMapped"]) >= 4096, peer
            assert int(b.numpy()[-1]) == 9  # the peer's write is ours
            assert os.listdir(isolated_shm) == []  # a memfd: no file to leak
            plat.free(b)
            assert not _kvf_fds()
        finally:
            plat.close()


def test_hugetlb_window_uses_reserved_pages_and_gives_them_back(isolated_shm):
    with machine(nr_hugepages=8):
        free0 = hp.support(isolated_shm).hugetlb_free
        plat = SimPlatform(config=SimConfig(hugepages="hugetlb"))
        try:
            b = plat.alloc(3 * MiB, Medium.DRAM, shareable=True)  # 2 pages of 2 MiB
            assert b.impl.kind is PageKind.HUGETLB and b.impl.mapped == 4 * MiB
            assert hp.support(isolated_shm).hugetlb_free == free0 - 2
            b.numpy()[:] = 5
            assert smaps_of(b.ptr)["KernelPageSize"] == "2048"
            peer = peer_view(plat, b)
            assert peer["first"] == 5 and peer["smaps"]["KernelPageSize"] == "2048", peer
            with pytest.raises(HugePagesUnavailable, match="7 free 2048 KiB pages needed, 6 free"):
                plat.alloc(13 * MiB, Medium.DRAM, shareable=True)
            plat.free(b)
            assert hp.support(isolated_shm).hugetlb_free == free0
            c = plat.alloc(2 * MiB, Medium.DRAM, shareable=True)
            handle = plat.export_handle(c)
            plat.free(c)
            with pytest.raises(HandleError, match="gone"):  # the handle dies with the segment
                plat.import_handle(handle)
        finally:
            plat.close()
        assert not _kvf_fds()


def test_a_failure_mid_creation_leaves_no_segment(isolated_shm, monkeypatch):
    with machine(shmem_enabled="advise"):

        def no_memory(addr: int, nbytes: int, what: str) -> None:
            raise shm.OutOfSpace(f"{what}: injected")

        monkeypatch.setattr(shm, "populate", no_memory)
        plat = SimPlatform(config=SimConfig(hugepages="thp"))
        try:
            with pytest.raises(shm.OutOfSpace, match="injected"):
                plat.alloc(4 * MiB, Medium.DRAM, shareable=True)
            assert plat.owned_bytes == 0 and not _kvf_fds() and not shm.owned_names()
        finally:
            plat.close()


def test_info_describes_the_machine(isolated_shm):
    text = hp.support(isolated_shm).describe()
    assert "THP for shmem" in text and "hugetlb" in text and "hugetlbfs mounts" in text


def test_pool_window_follows_the_pool_hugepages_setting(isolated_shm):
    from kvfabric.pool.config import PoolConfig
    from kvfabric.pool.service.node import EmbeddedPool

    with pytest.raises(ValueError, match="pool config hugepages='sometimes'"):
        PoolConfig(hugepages="sometimes")
    cfg = dict(dram=4 * MiB, max_objects=64, pretouch=False)
    with machine(shmem_enabled="never", nr_hugepages=0):
        with pytest.raises(HugePagesUnavailable, match="hugepages=on"):
            EmbeddedPool(PoolConfig(hugepages="on", **cfg))
        assert not _kvf_fds() and [n for n in os.listdir(isolated_shm) if "window" in n] == []
    with machine(shmem_enabled="advise"):
        pool = EmbeddedPool(PoolConfig(hugepages="thp", **cfg))
        try:
            assert pool.window is not None and pool.window.impl.kind is PageKind.THP
        finally:
            pool.close()


def test_persistent_segment_on_hugetlbfs_is_found_again_and_unlinked(isolated_shm, tmp_path):
    mnt = tmp_path / "hugetlbfs"
    mnt.mkdir()
    with machine(nr_hugepages=4):
        if subprocess.run(["mount", "-t", "hugetlbfs", "none", str(mnt)], capture_output=True).returncode:
            pytest.skip("cannot mount hugetlbfs here")
        try:
            plat = SimPlatform(config=SimConfig(hugepages="on"))
            try:
                b, created = plat.alloc_named("hp-window", 3 * MiB)
                assert created and b.impl.kind is PageKind.HUGETLB
                assert os.listdir(mnt) == ["kvf.n.hp-window"] and os.listdir(isolated_shm) == []
                b.numpy()[:] = 4
                peer = peer_view(plat, b)  # the handle is the file's path on the mount
                assert peer["first"] == 4 and peer["smaps"]["KernelPageSize"] == "2048", peer
                plat.free(b)
                again, created = plat.alloc_named("hp-window", 3 * MiB)  # a restart re-attaches
                assert not created and int(again.numpy()[0]) == 4 and int(again.numpy()[-1]) == 9
                plat.free(again)
                assert plat.unlink_named("hp-window") and os.listdir(mnt) == []
            finally:
                plat.close()
        finally:
            subprocess.run(["umount", str(mnt)], check=False)
