"""The page kinds a copy benchmark measures shared windows on (the ``pages`` field of its rows).

``kinds(window_bytes, windows)`` says which kinds this machine gives now (``4k`` always;
``thp`` when ``shmem_enabled`` allows memfd huge pages; ``hugetlb`` when enough reserved
pages are free for every window) and, for the others, a row saying why they were not
measured. ``peer_pages(kind)`` makes a peer process started inside it allocate its window
on that kind (``KVFABRIC_HUGEPAGES``, read by the peer's platform). ``pages_of(buffer)`` is
what a mapped window really is on, from the segment behind it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvfabric.platform import hugepages, shm
from kvfabric.platform.hugepages import PageKind, round_up, support

MODE = {PageKind.SMALL: "off", PageKind.THP: "thp", PageKind.HUGETLB: "hugetlb"}


def kinds(window_bytes: int, windows: int = 1) -> tuple[list[PageKind], list[dict[str, Any]]]:
    """The kinds to measure, and ``{"pages": ..., "skipped": why}`` rows for the others."""
    sup = support(shm.shm_dir())
    out, skipped = [PageKind.SMALL], []
    if sup.thp_memfd:
        out.append(PageKind.THP)
    else:
        skipped.append(
            {
                "pages": "thp",
                "skipped": f"shmem_enabled is {sup.thp_shmem or 'absent'} (needs advise or always)",
            }
        )
    need = round_up(window_bytes, sup.hugetlb_bytes) * windows if sup.hugetlb_bytes else 0
    if sup.hugetlb_bytes and sup.hugetlb_fits(need):
        out.append(PageKind.HUGETLB)
    else:
        skipped.append(
            {
                "pages": "hugetlb",
                "skipped": f"{need >> 20} MiB of hugetlb pages needed, {sup.hugetlb_free} free pages "
                f"of {sup.hugetlb_bytes >> 10} KiB (/proc/sys/vm/nr_hugepages = {sup.hugetlb_total})",
            }
        )
    return out, skipped


@contextmanager
def peer_pages(kind: PageKind) -> Iterator[None]:
    """Processes started inside the block allocate shareable windows on ``kind`` pages."""
    old = os.environ.get("KVFABRIC_HUGEPAGES")
    os.environ["KVFABRIC_HUGEPAGES"] = MODE[kind]
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KVFABRIC_HUGEPAGES", None)
        else:
            os.environ["KVFABRIC_HUGEPAGES"] = old


def pages_of(buffer: Any) -> str:
    """The page kind of the shared segment behind ``buffer`` (``4k`` when it has none)."""
    impl = buffer.impl
    seg = impl if isinstance(impl, shm.Segment) else getattr(impl, "seg", None)
    return seg.kind.value if isinstance(seg, shm.Segment) else PageKind.SMALL.value


def huge_mapped_kib(ptr: int) -> int:
    """KiB of this process's mapping holding ``ptr`` on huge pages now
    (``platform.hugepages.huge_mapped_kib``): the row's proof that ``pages`` is what it says."""
    return hugepages.huge_mapped_kib(ptr)
