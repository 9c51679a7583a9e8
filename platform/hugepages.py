"""What this machine allows for huge pages on shared memory, and which page kind a segment gets.

Three page kinds (:class:`PageKind`):

* ``4k``: a file in the shared-memory directory (``KVFABRIC_SHM_DIR``, a tmpfs), as always.
* ``thp``: shared memory on transparent huge pages. The kernel gives them to the internal
  shmem mount (``memfd_create``) when ``/sys/kernel/mm/transparent_hugepage/shmem_enabled``
  is ``advise`` (with ``madvise(MADV_HUGEPAGE)``, which kvfabric always gives), ``always``,
  ``within_size`` or ``force``; files of a tmpfs mount only when that mount says ``huge=``
  (``advise``, ``always``, ``within_size``) or ``shmem_enabled`` is ``force``. A plain
  ``/dev/shm`` (no ``huge=`` option) never gets them, whatever ``shmem_enabled`` says.
* ``hugetlb``: pages from the reserved pool (``/proc/sys/vm/nr_hugepages``), through
  ``memfd_create(MFD_HUGETLB)`` or a file on a ``hugetlbfs`` mount.

The ``hugepages`` setting (:class:`HugePages`): ``auto`` takes huge pages where the machine
allows them and 4 KiB pages otherwise, ``on`` is ``auto`` that fails (naming what is missing)
instead of falling back, ``thp`` / ``hugetlb`` ask for that kind only, ``off`` keeps 4 KiB
pages. Where both kinds are allowed, ``auto`` and ``on`` take ``hugetlb`` (reserved pages are
an operator's explicit choice). ``auto`` keeps segments smaller than one huge page on 4 KiB
pages (rounding them up would waste most of the page); the others round every segment up to
a whole number of huge pages.

Everything here reads sysfs / procfs when called (cheap), so a test that changes a setting
sees it at once. Leaf module: imports only the standard library and ``kvfabric.errors``.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path

from kvfabric.errors import PlatformError

THP_DIR = Path("/sys/kernel/mm/transparent_hugepage")
SHMEM_ENABLED = THP_DIR / "shmem_enabled"
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
THP_SHMEM_MODES = ("advise", "always", "within_size", "force")  # memfd gets huge pages
TMPFS_HUGE_MODES = ("advise", "always", "within_size")  # a tmpfs mount's huge= that gives them


class PageKind(enum.Enum):
    """The pages a segment lives on (the ``pages`` field of benchmark rows)."""

    SMALL = "4k"
    THP = "thp"
    HUGETLB = "hugetlb"


class HugePages(enum.Enum):
    """The ``hugepages`` setting (see the module docstring)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"
    THP = "thp"
    HUGETLB = "hugetlb"

    @classmethod
    def parse(cls, value: HugePages | str) -> HugePages:
        if isinstance(value, HugePages):
            return value
        v = str(value).strip().lower()
        for m in cls:
            if m.value == v:
                return m
        raise ValueError(f"hugepages={value!r}: expected one of {', '.join(m.value for m in cls)}")


class HugePagesUnavailable(PlatformError):
    """``hugepages`` asked for huge pages the machine does not give; the message says what is missing."""


@dataclass(frozen=True)
class Mount:
    path: str
    fstype: str
    options: tuple[str, ...]

    def option(self, key: str) -> str | None:
        for o in self.options:
            k, _, v = o.partition("=")
            if k == key:
                return v
        return None


@dataclass(frozen=True)
class HugePageSupport:
    """What the machine allows now (``kvfabric info`` prints it)."""

    thp_shmem: str  # the selected shmem_enabled mode ('' where the kernel has no THP)
    thp_bytes: int  # the PMD huge page size (hpage_pmd_size)
    hugetlb_bytes: int  # the default hugetlb page size (Hugepagesize)
    hugetlb_total: int  # HugePages_Total
    hugetlb_free: int  # HugePages_Free less HugePages_Rsvd
    hugetlbfs: tuple[str, ...]  # mount points of the default page size
    shm_dir: str
    shm_dir_huge: str  # the huge= option of the shm dir's tmpfs mount ('never' without one)

    @property
    def thp_memfd(self) -> bool:
        """``memfd_create`` segments get transparent huge pages."""
        return self.thp_shmem in THP_SHMEM_MODES

    @property
    def thp_files(self) -> bool:
        """Files in the shared-memory directory get transparent huge pages."""
        return self.thp_shmem == "force" or self.shm_dir_huge in TMPFS_HUGE_MODES

    def hugetlb_fits(self, nbytes: int) -> bool:
        return self.hugetlb_bytes > 0 and self.hugetlb_free * self.hugetlb_bytes >= nbytes

    def kinds(self) -> tuple[PageKind, ...]:
        """The page kinds a segment (not a persistent one) can get now."""
        out = [PageKind.SMALL]
        if self.thp_memfd:
            out.append(PageKind.THP)
        if self.hugetlb_free > 0:
            out.append(PageKind.HUGETLB)
        return tuple(out)

    def describe(self) -> str:
        return (
            f"THP for shmem: {self.thp_shmem or 'not built'} (memfd segments "
            f"{'get' if self.thp_memfd else 'do not get'} them; {self.shm_dir}: huge={self.shm_dir_huge}); "
            f"hugetlb: {self.hugetlb_total} pages of {self.hugetlb_bytes >> 10} KiB reserved, "
            f"{self.hugetlb_free} free; hugetlbfs mounts: {', '.join(self.hugetlbfs) or 'none'}"
        )


def _selected(text: str) -> str:
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text.strip()


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def mounts() -> list[Mount]:
    out = []
    for line in _read(Path("/proc/mounts")).splitlines():
        parts = line.split()
        if len(parts) >= 4:
            out.append(Mount(parts[1].replace("\\040", " "), parts[2], tuple(parts[3].split(","))))
    return out


def mount_of(path: str, table: list[Mount] | None = None) -> Mount | None:
    """The mount holding ``path`` (the longest mount point that is a prefix of it)."""
    real = os.path.realpath(path)
    best: Mount | None = None
    for m in table if table is not None else mounts():
        mp = m.path.rstrip("/") or "/"
        if (real == mp or real.startswith(mp + "/") or mp == "/") and (
            best is None or len(mp) >= len(best.path)
        ):
            best = m
    return best


def _meminfo() -> dict[str, int]:
    out = {}
    for line in _read(Path("/proc/meminfo")).splitlines():
        k, _, v = line.partition(":")
        try:
            out[k] = int(v.split()[0])
        except (IndexError, ValueError):
            pass
    return out


def support(shm_dir: str) -> HugePageSupport:
    """What the machine allows now for segments in ``shm_dir``."""
    mi = _meminfo()
    hugetlb = mi.get("Hugepagesize", 0) << 10
    try:
        thp = int(_read(THP_DIR / "hpage_pmd_size").strip() or 0)
    except ValueError:
        thp = 0
    table = mounts()
    fs = []
    for m in table:
        if m.fstype == "hugetlbfs":
            ps = m.option("pagesize")
            size = _parse_pagesize(ps) if ps else hugetlb
            if size == hugetlb and os.access(m.path, os.W_OK):
                fs.append(m.path)
    shm_mount = mount_of(shm_dir, table)
    huge = (
        shm_mount.option("huge") if shm_mount is not None and shm_mount.fstype == "tmpfs" else None
    ) or "never"
    return HugePageSupport(
        thp_shmem=_selected(_read(SHMEM_ENABLED)) if SHMEM_ENABLED.exists() else "",
        thp_bytes=thp or (2 << 20),
        hugetlb_bytes=hugetlb,
        hugetlb_total=mi.get("HugePages_Total", 0),
        hugetlb_free=max(mi.get("HugePages_Free", 0) - mi.get("HugePages_Rsvd", 0), 0),
        hugetlbfs=tuple(fs),
        shm_dir=shm_dir,
        shm_dir_huge=huge,
    )


def _parse_pagesize(text: str) -> int:
    t = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(t.rstrip("KMG")) * mult
    except ValueError:
        return 0


def round_up(nbytes: int, page: int) -> int:
    return -(-nbytes // page) * page


def choose(mode: HugePages, nbytes: int, sup: HugePageSupport, persistent: bool = False) -> PageKind:
    """The page kind a segment of ``nbytes`` gets under ``mode``; ``HugePagesUnavailable``
    naming what is missing when ``on`` / ``thp`` / ``hugetlb`` cannot be met.

    A persistent (named) segment must be a file that outlives its creator: ``hugetlb`` needs a
    writable hugetlbfs mount, ``thp`` a shm dir whose tmpfs mount gives huge pages."""
    if mode is HugePages.OFF:
        return PageKind.SMALL
    hugetlb_need = round_up(nbytes, sup.hugetlb_bytes) if sup.hugetlb_bytes else nbytes
    hugetlb_ok = sup.hugetlb_fits(hugetlb_need) and (bool(sup.hugetlbfs) or not persistent)
    thp_ok = sup.thp_files if persistent else sup.thp_memfd
    if mode is HugePages.AUTO:
        if nbytes < min(sup.thp_bytes, sup.hugetlb_bytes or sup.thp_bytes):
            return PageKind.SMALL
        return PageKind.HUGETLB if hugetlb_ok else PageKind.THP if thp_ok else PageKind.SMALL
    if mode in (HugePages.ON, HugePages.HUGETLB) and hugetlb_ok:
        return PageKind.HUGETLB
    if mode in (HugePages.ON, HugePages.THP) and thp_ok:
        return PageKind.THP
    raise HugePagesUnavailable(_missing(mode, nbytes, hugetlb_need, sup, persistent))


def _missing(mode: HugePages, nbytes: int, need: int, sup: HugePageSupport, persistent: bool) -> str:
    what = f"{'persistent ' if persistent else ''}segment of {nbytes} B"
    why = []
    if mode in (HugePages.ON, HugePages.HUGETLB):
        if not sup.hugetlb_bytes:
            why.append("this kernel has no hugetlb pages")
        elif not sup.hugetlb_fits(need):
            why.append(
                f"hugetlb: {need // sup.hugetlb_bytes} free {sup.hugetlb_bytes >> 10} KiB pages needed, "
                f"{sup.hugetlb_free} free of {sup.hugetlb_total} reserved ({NR_HUGEPAGES})"
            )
        if persistent and not sup.hugetlbfs:
            why.append("hugetlb: no writable hugetlbfs mount (mount -t hugetlbfs none /dev/hugepages)")
    if mode in (HugePages.ON, HugePages.THP):
        if persistent:
            why.append(
                f"thp: {sup.shm_dir} is on a tmpfs mounted with huge={sup.shm_dir_huge} "
                f"(needs huge=advise, always or within_size, or {SHMEM_ENABLED} = force)"
            )
        else:
            why.append(
                f"thp: {SHMEM_ENABLED} is {sup.thp_shmem or 'absent'} "
                "(needs advise, always, within_size or force)"
            )
    return f"hugepages={mode.value}: no huge pages for a {what}: " + "; ".join(why)


def smaps_of(ptr: int, pid: int | str = "self") -> dict[str, str]:
    """The ``/proc/PID/smaps`` fields of the mapping holding ``ptr`` (values as text, kB for
    the sizes): how a caller proves which pages a window really sits on."""
    inside, out = False, {}
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                if inside:
                    break
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside:
                out[head.rstrip(":")] = line.split()[1]
    return out


def huge_mapped_kib(ptr: int, pid: int | str = "self") -> int:
    """KiB of the mapping holding ``ptr`` that sit on huge pages now (``ShmemPmdMapped`` +
    ``FilePmdMapped``; ``Shared_Hugetlb`` + ``Private_Hugetlb`` where its ``KernelPageSize``
    is a hugetlb page, counted apart from Rss)."""
    fields = {k: int(v) if v.isdigit() else 0 for k, v in smaps_of(ptr, pid).items()}
    if fields.get("KernelPageSize", 4) > 4:
        return fields.get("Shared_Hugetlb", 0) + fields.get("Private_Hugetlb", 0)
    return fields.get("ShmemPmdMapped", 0) + fields.get("FilePmdMapped", 0)
