"""Large sim buffers ask the kernel for transparent huge pages (as numpy's large arrays do),
which is what lets a platform copy run at memcpy speed against a huge-page baseline."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfabric.platform.shm import HUGE_PAGE_BYTES
from kvfabric.platform.sim.backend import SimPlatform
from kvfabric.platform.types import Medium

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_eligible(ptr: int) -> bool | None:
    """The kernel's ``THPeligible`` flag of the mapping holding ``ptr`` (None: not shown)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off here"
)
def test_large_private_buffers_are_huge_page_eligible_small_ones_untouched():
    plat = SimPlatform()
    try:
        big = plat.alloc(HUGE_PAGE_BYTES, Medium.DRAM)
        small = plat.alloc(64 << 10, Medium.HBM)
        flag = _thp_eligible(big.ptr)
        if flag is None:
            pytest.skip("this kernel does not report THPeligible in smaps")
        assert flag is True
        if "[madvise]" in THP.read_text():  # only the advice makes a mapping eligible
            assert _thp_eligible(small.ptr) is False
        big.numpy()[:] = 7  # the memory works as before
        assert int(big.numpy()[::4096].sum()) == 7 * (HUGE_PAGE_BYTES // 4096)
    finally:
        plat.close()
