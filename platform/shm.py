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
"""

from __future__ import annotations

import atexit
import errno
import itertools
import mmap
import os
import secrets
import threading
from dataclasses import dataclass

import numpy as np

from kvfabric.envs import KVFABRIC_SHM_DIR
from kvfabric.errors import HandleError, OutOfSpace

PREFIX = "kvf."
_counter = itertools.count()
_owned: dict[str, str] = {}  # name -> path, segments this process must unlink
_owned_lock = threading.Lock()


def shm_dir() -> str:
    return KVFABRIC_SHM_DIR.get()


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
    """One mapped segment. ``array`` is a uint8 view whose address is the buffer's."""

    name: str
    path: str
    nbytes: int
    mm: mmap.mmap | None
    array: np.ndarray | None
    owner: bool

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


def _map(fd: int, nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    advise_huge(mm, nbytes)
    return mm, np.frombuffer(mm, dtype=np.uint8)


def create(nbytes: int, directory: str | None = None) -> Segment:
    """Create, reserve and map a new segment of ``nbytes`` owned by this process."""
    if nbytes <= 0:
        raise ValueError(f"segment size must be > 0, got {nbytes}")
    d = directory or shm_dir()
    name = f"{PREFIX}{os.getpid()}.{_MY_START}.{next(_counter)}.{secrets.token_hex(4)}"
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
        mm, arr = _map(fd, nbytes)
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


def open_named(name: str, nbytes: int, directory: str | None = None) -> tuple[Segment, bool]:
    """Create the persistent segment ``kvf.n.<name>``, or map it if it already exists with
    this size; ``(segment, created)``. It outlives every process (never unlinked at exit,
    never swept) until :func:`unlink_named`."""
    if nbytes <= 0:
        raise ValueError(f"segment size must be > 0, got {nbytes}")
    full, path = _named(name, directory)
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
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    free = _free_bytes(os.path.dirname(path))
                    raise OutOfSpace(
                        f"shared memory of {nbytes} B for {full!r} does not fit ({free} B free): {e}"
                    ) from e
                raise
        else:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise HandleError(f"segment {full!r} exists with {size} B, not {nbytes} B")
        mm, arr = _map(fd, nbytes)
    except BaseException:
        if created:  # a segment this call created and could not hand over: never leave it behind
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        raise
    finally:
        os.close(fd)
    return Segment(full, path, nbytes, mm, arr, owner=False), created


def unlink_named(name: str, directory: str | None = None) -> bool:
    """Delete the persistent segment ``kvf.n.<name>``; False if it did not exist."""
    _, path = _named(name, directory)
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def attach(name: str, nbytes: int, directory: str | None = None) -> Segment:
    """Map an existing segment created by another process (never unlinks it)."""
    if not name.startswith(PREFIX) or "/" in name:
        raise HandleError(f"{name!r} is not a kvfabric shared-memory segment name")
    d = directory or shm_dir()
    path = os.path.join(d, name)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError as e:
        raise HandleError(f"shared-memory segment {name!r} is gone (its owner freed it or exited)") from e
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise HandleError(f"segment {name!r} has {size} B, the handle says {nbytes} B")
        mm, arr = _map(fd, nbytes)
    finally:
        os.close(fd)
    return Segment(name, path, nbytes, mm, arr, owner=False)


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
