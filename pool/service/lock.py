"""``PidLock``: an exclusive ``flock`` on a file that names its holder's pid.

The pool daemon holds two for its whole life (``daemon.py``): one beside its socket
(``<socket>.lock``) and one beside its segments (``.kvf-pool-<name>.lock`` in the
shared-memory directory), so at most one daemon runs per socket and per pool name. A
lock is taken, not probed: of any number of daemons started at once exactly one gets
it; the kernel drops it when the holder dies, however it dies, so a crash leaves no
stale lock (the file may stay; the next holder reuses it).

Call order: ``PidLock.acquire(path, holder, what)`` -> the holder's work -> ``release()``, which
unlinks the file while still holding it, then closes it. A contender that opened the
file just before that unlink would lock a name nobody else sees, so ``acquire`` checks
after locking that the path still is the file it locked, and starts over if not.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time

from kvfabric.errors import KVFabricError

_PID_WAIT_S = 1.0  # a holder writes its pid right after locking; wait this long to read it


class AlreadyRunning(KVFabricError, ValueError):
    """Another live process holds the lock; the message names its pid."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid


class PidLock:
    """See module docstring. Not reentrant; one holder per process and path."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, path: str, holder: str, what: str) -> PidLock:
        """Take the lock at ``path`` or raise :class:`AlreadyRunning`: "``holder`` (pid N)
        ``what``", e.g. "a pool daemon (pid 123) already serves /run/x.sock"."""
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    os.close(fd)
                    raise
                pid = _holder_pid(fd)
                os.close(fd)
                who = f"pid {pid}" if pid is not None else "pid unknown"
                raise AlreadyRunning(f"{holder} ({who}) {what}", pid) from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if not same:  # the previous holder unlinked it between our open and flock
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return cls(path, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Remove the file and drop the lock. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(fd)


def _holder_pid(fd: int) -> int | None:
    deadline = time.monotonic() + _PID_WAIT_S
    while True:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text.isdigit():
            return int(text)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)
