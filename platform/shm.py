"""POSIX shared-memory segments that never outlive their owner.

A segment is a file in a tmpfs directory (``/dev/shm`` by default, ``KVFABRIC_SHM_DIR``)
created with mode 0600 and fully reserved up front (``posix_fallocate``), so a full tmpfs
fails the allocation with ``OutOfSpace`` instead of killing the process with SIGBUS on a
later write.

Ownership: the creating process owns the name. It unlinks it on ``unlink()``, and at
interpreter exit for any it still holds. A process killed outright cannot do either, so
the name carries the owner's pid and start time (``kvf.<pid>.<start>.<n>.<rand>``) and
``sweep()`` (run whenever a platform starts) unlinks segments whose owner is gone.
Attaching processes map the memory and never unlink it; a mapping stays valid after
the name is unlinked.

Huge pages (``hugepages``, see ``platform/hugepages.py`` for what the machine must allow):
a segment on transparent huge pages or reserved hugetlb pages that dies with its owner is a
memfd segment (``platform/memfd.py``: shared through ``/proc/<pid>/fd``, with an identity
check on attach); :func:`create` and :func:`attach` hand those to it. Persistent segments
(``open_named``) must outlive their creator, so they stay files: on a hugetlbfs mount for
hugetlb pages (the handle is then the file's path), or in the shm dir when its tmpfs mount
gives huge pages (``huge=``). A THP file or memfd is populated through its advised mapping
(:func:`populate`: the pages are allocated, and a shortfall is an ``OutOfSpace``, at
creation, as ``posix_fallocate`` does for a file).

This module holds the contract both kinds share: :class:`Segment` (who owns it, what
``ref`` another process passes to :func:`attach`), the mapping helpers (:func:`map_fd`,
:func:`populate`, :func:`close_quietly`) and the owner-liveness helpers.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import ctypes
import errno
import itertools
import mmap
import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvfabric.envs import KVFABRIC_HUGEPAGES, KVFABRIC_SHM_DIR
from kvfabric.errors import HandleError, OutOfSpace
from kvfabric.platform.hugepages import HugePages, PageKind, choose, round_up, support

PREFIX = "kvf."
_counter = itertools.count()
_owned: dict[str, str] = {}  # name -> path, segments this process must unlink
_owned_lock = threading.Lock()


def shm_dir() -> str:
    return KVFABRIC_SHM_DIR.get()


_override: contextvars.ContextVar[HugePages | None] = contextvars.ContextVar(
    "kvfabric_hugepages", default=None
)


def default_hugepages() -> HugePages:
    """The ``hugepages`` mode of platforms not told otherwise (``KVFABRIC_HUGEPAGES``, default auto)."""
    return HugePages.parse(KVFABRIC_HUGEPAGES.get())


def effective_hugepages(configured: HugePages | None) -> HugePages:
    """The mode a platform's next shareable allocation uses: a :func:`hugepages_for` block's,
    else the platform's configured one, else :func:`default_hugepages`."""
    return _override.get() or configured or default_hugepages()


@contextlib.contextmanager
def hugepages_for(mode: HugePages | str | None) -> Iterator[None]:
    """Within the block (this thread / task), shareable allocations use ``mode`` (None: no
    change); the pool service allocates its window under its ``hugepages`` setting so."""
    if mode is None:
        yield
        return
    token = _override.set(HugePages.parse(mode))
    try:
        yield
    finally:
        _override.reset(token)


def _start_time(pid: int) -> int | None:
    """The process start time in clock ticks since boot (``/proc/<pid>/stat`` field 22)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        rest = data[data.rindex(b")") + 2 :].split()
        return int(rest[19])
    except (ValueError, IndexError):
        return None


_MY_START = _start_time(os.getpid()) or 0


@dataclass
class Segment:
    """One mapped segment. ``array`` is a uint8 view of ``nbytes`` whose address is the
    buffer's; the mapping may be longer (``mapped``: rounded up to whole huge pages).
    ``ref`` is what another process passes to :func:`attach`."""

    name: str
    path: str
    nbytes: int
    mm: mmap.mmap | None
    array: np.ndarray | None
    owner: bool
    kind: PageKind = PageKind.SMALL
    fd: int | None = None  # memfd segments: the owner's descriptor, which others open
    mapped: int = 0

    @property
    def ref(self) -> str:
        if self.fd is not None:
            return f"{self.name}@{self.fd}"
        if os.path.dirname(self.path) != os.path.realpath(shm_dir()) and self.kind is PageKind.HUGETLB:
            return self.path  # a persistent segment on a hugetlbfs mount
        return self.name

    @property
    def ptr(self) -> int:
        if self.array is None:
            raise ValueError(f"segment {self.name} is closed")
        return int(self.array.ctypes.data)

    def close(self) -> None:
        """Unmap this process's mapping (if no view is still held, else leave it to GC)."""
        self.array = None
        mm, self.mm = self.mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a user view still aliases it; the mapping goes when that view dies

    def unlink(self) -> None:
        """Remove the name (owner only). Idempotent."""
        if not self.owner:
            raise ValueError(f"segment {self.name} is not owned by this process")
        if self.fd is not None:
            from kvfabric.platform import memfd

            memfd.close_owned(self.name)
            self.fd = None
        else:
            _unlink(self.name, self.path)


def _unlink(name: str, path: str) -> None:
    with _owned_lock:
        _owned.pop(name, None)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


HUGE_PAGE_BYTES = 4 << 20  # mappings from this size on ask for transparent huge pages


def advise_huge(mm: mmap.mmap, nbytes: int) -> None:
    """Ask for transparent huge pages on a large mapping, as numpy does for its large
    arrays: a copy through 4 KiB pages pays a TLB miss every 4 KiB (measured on the 2-core
    development machine: 0.6 to 0.85 of a huge-page memcpy, the less the colder the page
    tables). Where the kernel does not give them for this kind of
    memory (``shmem_enabled`` = never for tmpfs segments) nothing changes."""
    if nbytes >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass


SMALLEST_HUGE_PAGE = 2 << 20  # auto never puts a segment below this on huge pages (no sysfs read)
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in for writing, errors instead of SIGBUS
_libc = ctypes.CDLL(None, use_errno=True)


def populate(addr: int, nbytes: int, what: str) -> None:
    """Allocate every page of a fresh mapping at ``addr`` now, through the mapping (so its
    huge page advice applies), with an ``OutOfSpace`` instead of a SIGBUS when memory runs out."""
    if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), MADV_POPULATE_WRITE) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EINVAL:  # an older kernel: touch the pages (zeros into fresh zero pages)
        raw = (ctypes.c_uint8 * nbytes).from_address(addr)
        np.frombuffer(raw, dtype=np.uint8)[::4096] = 0
        return
    raise OutOfSpace(f"{what}: the pages do not fit ({os.strerror(err)})")


def map_fd(
    fd: int, nbytes: int, mapped: int | None = None, kind: PageKind = PageKind.SMALL
) -> tuple[mmap.mmap, np.ndarray]:
    length = mapped or nbytes
    mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if kind is PageKind.THP and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    else:
        advise_huge(mm, length)
    return mm, np.frombuffer(mm, dtype=np.uint8, count=nbytes)


def close_quietly(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a view still aliases it; the mapping goes with that view


def _new_name() -> str:
    return f"{PREFIX}{os.getpid()}.{_MY_START}.{next(_counter)}.{secrets.token_hex(4)}"


def create(nbytes: int, directory: str | None = None, hugepages: HugePages | str = HugePages.OFF) -> Segment:
    """Create, reserve and map a new segment of ``nbytes`` owned by this process, on the
    pages ``hugepages`` chooses (``platform/hugepages.py``; ``HugePagesUnavailable`` when
    ``on``, ``thp`` or ``hugetlb`` cannot be met). Nothing is left behind when it fails."""
    if nbytes <= 0:
        raise ValueError(f"segment size must be > 0, got {nbytes}")
    d = directory or shm_dir()
    mode = HugePages.parse(hugepages)
    name = _new_name()
    if mode is not HugePages.OFF and not (mode is HugePages.AUTO and nbytes < SMALLEST_HUGE_PAGE):
        sup = support(d)
        kind = choose(mode, nbytes, sup)
        if kind is not PageKind.SMALL:
            page = sup.hugetlb_bytes if kind is PageKind.HUGETLB else sup.thp_bytes
            from kvfabric.platform import memfd

            return memfd.create(name, nbytes, kind, page)
    path = os.path.join(d, name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileNotFoundError as e:
        raise OutOfSpace(f"shared-memory directory {d!r} does not exist") from e
    with _owned_lock:
        _owned[name] = path
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                free = _free_bytes(d)
                raise OutOfSpace(f"shared memory of {nbytes} B does not fit in {d!r} ({free} B free)") from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, nbytes)  # a filesystem without fallocate: size it lazily
        mm, arr = map_fd(fd, nbytes)
    except BaseException:
        _unlink(name, path)
        raise
    finally:
        os.close(fd)
    return Segment(name, path, nbytes, mm, arr, owner=True)


NAMED = "kvf.n."
_NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def _named(name: str, directory: str | None) -> tuple[str, str]:
    if not name or not set(name) <= _NAME_OK or len(name) > 200:
        raise ValueError(f"segment name {name!r}: use 1-200 letters, digits, '_', '.', '-'")
    full = NAMED + name
    return full, os.path.join(directory or shm_dir(), full)


def _named_paths(full: str, path: str, hugetlbfs: tuple[str, ...]) -> list[str]:
    return [path] + [os.path.join(m, full) for m in hugetlbfs]


def open_named(
    name: str, nbytes: int, directory: str | None = None, hugepages: HugePages | str = HugePages.OFF
) -> tuple[Segment, bool]:
    """Create the persistent segment ``kvf.n.<name>``, or map it if it already exists with
    this size (wherever it was created: the shm dir or a hugetlbfs mount); ``(segment,
    created)``. It outlives every process (never unlinked at exit, never swept) until
    :func:`unlink_named`. ``hugepages`` chooses the pages of a new one (a file: hugetlb on a
    hugetlbfs mount, thp in a shm dir whose mount gives them)."""
    if nbytes <= 0:
        raise ValueError(f"segment size must be > 0, got {nbytes}")
    full, path = _named(name, directory)
    d = os.path.dirname(path)
    mode = HugePages.parse(hugepages)
    sup = support(d)
    kind, page = PageKind.SMALL, 0
    existing = next((p for p in _named_paths(full, path, sup.hugetlbfs) if os.path.exists(p)), None)
    if existing is not None:
        path = existing
        if path != _named(name, directory)[1]:
            kind, page = PageKind.HUGETLB, sup.hugetlb_bytes
    elif mode is not HugePages.OFF:
        kind = choose(mode, nbytes, sup, persistent=True)
        if kind is PageKind.HUGETLB:
            path, page = os.path.join(sup.hugetlbfs[0], full), sup.hugetlb_bytes
        elif kind is PageKind.THP:
            page = sup.thp_bytes
    size = round_up(nbytes, page) if page else nbytes
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        created = True
    except FileExistsError:
        fd = os.open(path, os.O_RDWR)
        created = False
    except FileNotFoundError as e:
        raise OutOfSpace(f"shared-memory directory {os.path.dirname(path)!r} does not exist") from e
    try:
        if created:
            try:
                if kind is PageKind.THP:
                    os.ftruncate(fd, size)  # allocated through the advised mapping below
                else:
                    if kind is PageKind.HUGETLB:
                        os.ftruncate(fd, size)
                    os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    free = _free_bytes(os.path.dirname(path))
                    raise OutOfSpace(
                        f"shared memory of {nbytes} B for {full!r} does not fit ({free} B free): {e}"
                    ) from e
                raise
        else:
            have = os.fstat(fd).st_size
            if have != size:
                raise HandleError(f"segment {full!r} exists with {have} B, not {nbytes} B")
        mm, arr = map_fd(fd, nbytes, size, kind)
        if created and kind is PageKind.THP:
            try:
                populate(int(arr.ctypes.data), size, f"shared memory of {nbytes} B for {full!r}")
            except BaseException:
                del arr
                close_quietly(mm)
                raise
    except BaseException:
        if created:  # a segment this call created and could not hand over: never leave it behind
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        raise
    finally:
        os.close(fd)
    return Segment(full, path, nbytes, mm, arr, owner=False, kind=kind, mapped=size), created


def unlink_named(name: str, directory: str | None = None) -> bool:
    """Delete the persistent segment ``kvf.n.<name>`` (wherever it lives); False if it did not exist."""
    full, path = _named(name, directory)
    found = False
    for p in _named_paths(full, path, support(os.path.dirname(path)).hugetlbfs):
        try:
            os.unlink(p)
            found = True
        except FileNotFoundError:
            pass
    return found


def attach(name: str, nbytes: int, directory: str | None = None) -> Segment:
    """Map an existing segment created by another process (never unlinks it); ``name`` is
    the creator's :attr:`Segment.ref`."""
    from kvfabric.platform import memfd

    if memfd.is_ref(name):
        return memfd.attach(name, nbytes)
    d = directory or shm_dir()
    kind = PageKind.SMALL
    if name.startswith("/"):  # a persistent segment on a hugetlbfs mount
        base = os.path.basename(name)
        if not base.startswith(PREFIX) or os.path.dirname(name) not in support(d).hugetlbfs:
            raise HandleError(f"{name!r} is not a kvfabric segment on a hugetlbfs mount")
        path, name, kind = name, base, PageKind.HUGETLB
    elif not name.startswith(PREFIX) or "/" in name:
        raise HandleError(f"{name!r} is not a kvfabric shared-memory segment name")
    else:
        path = os.path.join(d, name)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError as e:
        raise HandleError(f"shared-memory segment {name!r} is gone (its owner freed it or exited)") from e
    try:
        st = os.fstat(fd)
        if st.st_size < nbytes:
            raise HandleError(f"segment {name!r} has {st.st_size} B, the handle says {nbytes} B")
        size = min(round_up(nbytes, st.st_blksize), st.st_size) if kind is PageKind.HUGETLB else nbytes
        mm, arr = map_fd(fd, nbytes, size, kind)
    finally:
        os.close(fd)
    return Segment(name, path, nbytes, mm, arr, owner=False, kind=kind, mapped=size)


def _free_bytes(d: str) -> int:
    try:
        st = os.statvfs(d)
        return st.f_bavail * st.f_frsize
    except OSError:
        return -1


@dataclass(frozen=True)
class SegmentInfo:
    name: str
    nbytes: int
    owner_pid: int
    owner_alive: bool


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (on this node; a pid <= 0 never does)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def owner_alive(name: str) -> bool:
    """Whether the process that created segment ``name`` still runs (pid + start time)."""
    try:
        _, pid_s, start_s, *_ = name.split(".")
        pid, start = int(pid_s), int(start_s)
    except ValueError:
        return True  # not ours to judge
    actual = _start_time(pid)
    return actual is not None and (start == 0 or actual == start)


def list_segments(directory: str | None = None) -> list[SegmentInfo]:
    d = directory or shm_dir()
    out = []
    try:
        names = sorted(n for n in os.listdir(d) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []
    for n in names:
        try:
            size = os.stat(os.path.join(d, n)).st_size
        except FileNotFoundError:
            continue
        try:
            pid = int(n.split(".")[1])
        except (IndexError, ValueError):
            pid = -1
        out.append(SegmentInfo(n, size, pid, owner_alive(n)))
    return out


def sweep(directory: str | None = None) -> list[str]:
    """Unlink segments whose owner process is gone; return their names."""
    d = directory or shm_dir()
    removed = []
    for info in list_segments(d):
        if not info.owner_alive:
            try:
                os.unlink(os.path.join(d, info.name))
                removed.append(info.name)
            except FileNotFoundError:
                pass
    return removed


def owned_names() -> list[str]:
    with _owned_lock:
        return list(_owned)


@atexit.register
def _unlink_all_owned() -> None:
    with _owned_lock:
        items = list(_owned.items())
    for name, path in items:
        _unlink(name, path)


def _after_fork_in_child() -> None:
    # A forked child inherits the parent's table but owns none of those names.
    global _MY_START, _owned_lock
    _owned_lock = threading.Lock()
    _owned.clear()
    _MY_START = _start_time(os.getpid()) or 0


os.register_at_fork(after_in_child=_after_fork_in_child)
