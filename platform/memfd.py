"""Shared-memory segments on huge pages that die with their owner: ``memfd_create`` files.

A segment on transparent huge pages or reserved hugetlb pages is a ``memfd_create`` file
(``MFD_HUGETLB`` for hugetlb) named like a ``platform/shm.py`` segment
(``kvf.<pid>.<start>.<n>.<rand>``), rounded up to whole huge pages, advised
``MADV_HUGEPAGE`` and populated through the mapping (``shm.populate``: the pages are
allocated, and a shortfall is an ``OutOfSpace``, at creation, as ``posix_fallocate`` does for
a file).

Call order: ``shm.create`` picks the pages and calls :func:`create`; the owner hands
``Segment.ref`` (``<name>@<fd>``) to other processes of the node, whose ``shm.attach`` calls
:func:`attach` (:func:`is_ref` tells such a handle apart). Other processes open the memory
through the owner's descriptor, ``/proc/<pid>/fd/<fd>``, and an attach checks that the
descriptor still holds a memfd of that very name: a reused descriptor number or a reused pid
is "gone" (``HandleError``), never another segment's bytes.

Ownership: the creating process holds the descriptor (this module's table) until
``Segment.unlink`` (:func:`close_owned`) or interpreter exit; a forked child closes its
inherited copies. Such a segment cannot outlive its owner, so it needs no sweep: the kernel
frees it when the owner and every mapping are gone. Attaching processes map it and close
their descriptor at once; their mapping stays valid until ``Segment.close``.
"""

from __future__ import annotations

import atexit
import mmap
import os
import threading

from kvfabric.errors import HandleError, OutOfSpace
from kvfabric.platform import shm
from kvfabric.platform.hugepages import PageKind, round_up

_owned_fds: dict[str, int] = {}  # name -> descriptor, memfd segments this process must close
_owned_lock = threading.Lock()


def is_ref(ref: str) -> bool:
    """Whether ``ref`` is a memfd segment's handle (``kvf.<pid>...@<fd>``), not a file's name or path."""
    return "@" in ref and ref.startswith(shm.PREFIX) and "/" not in ref


def close_owned(name: str) -> None:
    """Close this process's descriptor of its memfd segment ``name`` (idempotent): once every
    mapping is gone too, the kernel frees the memory."""
    with _owned_lock:
        fd = _owned_fds.pop(name, None)
    if fd is not None:
        os.close(fd)


def create(name: str, nbytes: int, kind: PageKind, page: int) -> shm.Segment:
    """A memfd segment ``name`` of ``nbytes`` on ``kind`` pages of ``page`` bytes, mapped
    and owned by this process (see the module docstring); nothing is left behind when it fails."""
    size = round_up(nbytes, page)
    flags = os.MFD_CLOEXEC | (os.MFD_HUGETLB if kind is PageKind.HUGETLB else 0)
    what = f"shared memory of {nbytes} B on {kind.value} pages ({size} B)"
    try:
        fd = os.memfd_create(name, flags)
    except OSError as e:
        raise OutOfSpace(f"{what}: memfd_create failed: {e}") from e
    try:
        os.ftruncate(fd, size)
        if kind is PageKind.HUGETLB:  # reserves the pool's pages now: ENOSPC when they run out
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise OutOfSpace(f"{what} does not fit in the free hugetlb pages: {e}") from e
        mm, arr = shm.map_fd(fd, nbytes, size, kind)
        try:
            if kind is PageKind.THP:
                shm.populate(int(arr.ctypes.data), size, what)
        except BaseException:
            del arr
            shm.close_quietly(mm)
            raise
    except BaseException:
        os.close(fd)
        raise
    with _owned_lock:
        _owned_fds[name] = fd
    return shm.Segment(name, f"/proc/{os.getpid()}/fd/{fd}", nbytes, mm, arr, True, kind, fd, size)


def attach(ref: str, nbytes: int) -> shm.Segment:
    """Map the memfd segment another process of the node handed out as ``ref``
    (``<name>@<fd>``), through ``/proc/<pid>/fd/<fd>``; ``HandleError`` when its owner freed it
    or exited, or when that descriptor now holds another memfd (a reused fd or pid)."""
    name, _, fd_s = ref.rpartition("@")
    try:
        pid, fdn = int(name.split(".")[1]), int(fd_s)
    except (IndexError, ValueError):
        raise HandleError(f"{ref!r} is not a kvfabric shared-memory segment handle") from None
    proc = f"/proc/{pid}/fd/{fdn}"
    gone = f"shared-memory segment {name!r} is gone (its owner freed it or exited)"
    try:
        target = os.readlink(proc)
        fd = os.open(proc, os.O_RDWR)
    except FileNotFoundError as e:
        raise HandleError(gone) from e
    except PermissionError as e:
        raise HandleError(
            f"cannot open segment {name!r} through {proc} (another user's process?): {e}"
        ) from e
    try:
        if target != f"/memfd:{name} (deleted)" or os.readlink(f"/proc/self/fd/{fd}") != target:
            raise HandleError(gone)  # the descriptor (or the pid) was reused
        st = os.fstat(fd)
        if st.st_size < nbytes:
            raise HandleError(f"segment {name!r} has {st.st_size} B, the handle says {nbytes} B")
        # the whole memfd, as its owner rounded it: whole huge pages, aligned like the owner's
        size = st.st_size
        kind = PageKind.HUGETLB if st.st_blksize > mmap.PAGESIZE else PageKind.THP  # hugetlb: its page size
        mm, arr = shm.map_fd(fd, nbytes, size, kind)
    finally:
        os.close(fd)
    return shm.Segment(name, proc, nbytes, mm, arr, owner=False, kind=kind, mapped=size)


@atexit.register
def _close_all_owned() -> None:
    for name in list(_owned_fds):
        close_owned(name)


def _after_fork_in_child() -> None:
    # The parent's memfd segments are theirs to free, not the child's.
    global _owned_lock
    _owned_lock = threading.Lock()
    for fd in _owned_fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _owned_fds.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
