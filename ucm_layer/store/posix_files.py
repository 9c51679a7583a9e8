"""File layout and atomic writes of the posix store.

Layout: ``<dir>/<xyz>/<32 hex digits of the id>``, where ``<dir>`` is one of the backend
directories (chosen by the id's first two bytes) and ``<xyz>`` the id's first three hex
digits (up to 4096 prefix directories per backend directory, each made by the first
write that needs it). A block file holds its shards
at fixed offsets: shard ``k`` at ``k * shard_bytes``; the file's size is exactly
``num_shards * shard_bytes``.

Atomicity (no torn block is ever visible, whoever dies when):

* One shard per block: the writer writes ``<id>.<host>.<pid>.<n>.tmp`` next to the final
  name and renames it into place once complete. A writer killed before the rename leaves
  only a ``.tmp`` file, which maintenance removes (at once when its pid is dead on this
  host, else after ``tmp_ttl``).
* Several shards per block (written by different calls, possibly different processes):
  writers share ``<id>.part``, sized ``num_shards * shard_bytes + num_shards``; the
  trailing bytes are arrival flags. A writer takes a shared ``flock``, checks the
  file is still the current ``.part`` (same inode), writes its shard, then sets its flag;
  then under an exclusive lock, whoever sees every flag set truncates the flags away and
  renames the file into place. A shard written but not flagged is simply rewritten by
  the next writer of that shard.

``FileIO`` wraps the system calls so tests can inject ENOSPC, I/O errors and stalls.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import socket
from collections.abc import Sequence

import numpy as np

from kvfabric.ucm_layer.hashing import to_hex

PREFIX_DIGITS = 3
PREFIX_DIRS = 16**PREFIX_DIGITS  # 4096
ALIGN = 4096  # O_DIRECT alignment of offsets, sizes and memory
HOST = socket.gethostname().replace(".", "_") or "host"
_counter = itertools.count()


class FileIO:
    """The system calls of the posix store (override in tests to inject failures)."""

    def open_read(self, path: str, direct: bool) -> int:
        return os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))

    def open_new(self, path: str, direct: bool) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
        return os.open(path, flags, 0o644)

    def open_part(self, path: str) -> int:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def read_into(self, fd: int, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short read: {done} of {len(view)} B at offset {offset}")
            done += n

    def read_scatter(self, fd: int, views: list[memoryview], offset: int) -> None:
        """Fill ``views`` in order from ``offset`` with as few ``preadv`` calls as it takes."""
        pending = [v for v in views if len(v)]
        pos = offset
        while pending:
            n = os.preadv(fd, pending, pos)
            if n <= 0:
                raise OSError(errno.EIO, f"short read at offset {pos}")
            pos += n
            while pending and n >= len(pending[0]):
                n -= len(pending[0])
                pending.pop(0)
            if pending and n:
                pending[0] = pending[0][n:]

    def write_from(self, fd: int, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            n = os.pwritev(fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short write: {done} of {len(view)} B at offset {offset}")
            done += n

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def touch(self, fd: int) -> None:
        os.utime(fd)


class BlockFiles:
    """Where each block's file lives (see module docstring)."""

    def __init__(self, dirs: Sequence[str]) -> None:
        self.dirs = tuple(os.path.join(d, "") for d in dirs)  # with a trailing separator
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)  # prefix directories are made on first write

    def dir_index(self, ids: np.ndarray) -> np.ndarray:
        if len(self.dirs) == 1:
            return np.zeros(len(ids), np.int64)
        return ((ids[:, 0].astype(np.int64) << 8) | ids[:, 1]) % len(self.dirs)

    def paths(self, ids: np.ndarray) -> list[str]:
        """The final path of each id (O(n) string building, no system calls)."""
        hexes = to_hex(ids)
        if len(self.dirs) == 1:
            d = self.dirs[0]
            return [f"{d}{h[:PREFIX_DIGITS]}/{h}" for h in hexes]
        dirs = self.dirs
        return [f"{dirs[k]}{h[:PREFIX_DIGITS]}/{h}" for k, h in zip(self.dir_index(ids).tolist(), hexes)]

    @staticmethod
    def exists(paths: Sequence[str]) -> np.ndarray:
        ok = list(map(os.access, paths, itertools.repeat(os.F_OK)))
        return np.array(ok, dtype=bool) if ok else np.zeros(0, bool)

    @staticmethod
    def tmp_name(final: str) -> str:
        return f"{final}.{HOST}.{os.getpid()}.{next(_counter)}.tmp"

    @staticmethod
    def part_name(final: str) -> str:
        return final + ".part"


def write_single(io: FileIO, final: str, view: memoryview, direct: bool, fsync: bool) -> str:
    """Write a one-shard block to a fresh temporary file; return its name (not yet visible).
    On failure the temporary file is removed and the error raised."""
    tmp = BlockFiles.tmp_name(final)
    try:
        fd = io.open_new(tmp, direct)
    except FileNotFoundError:  # first block of this prefix directory
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        fd = io.open_new(tmp, direct)
    try:
        io.write_from(fd, view, 0)
        if fsync:
            io.fsync(fd)
    except BaseException:
        io.close(fd)
        io.unlink(tmp)
        raise
    io.close(fd)
    return tmp


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class PartWriter:
    """One shard into a shared ``.part`` file (see module docstring); used as a context."""

    def __init__(self, io: FileIO, final: str, num_shards: int, shard_bytes: int, fsync: bool) -> None:
        self.io, self.final, self.part = io, final, BlockFiles.part_name(final)
        self.num_shards, self.shard_bytes, self.fsync = num_shards, shard_bytes, fsync
        self.fd = -1

    @property
    def data_bytes(self) -> int:
        return self.num_shards * self.shard_bytes

    def write(self, shard: int, view: memoryview) -> bool:
        """Write shard data (not flagged yet). False when the block got complete meanwhile."""
        for _ in range(100):
            if os.access(self.final, os.F_OK):
                return False
            try:
                fd = self.io.open_part(self.part)
            except FileNotFoundError:  # first block of this prefix directory
                os.makedirs(os.path.dirname(self.part), exist_ok=True)
                fd = self.io.open_part(self.part)
            fcntl.flock(fd, fcntl.LOCK_SH)
            if _same_file(fd, self.part):
                self.fd = fd
                self.io.write_from(fd, view, shard * self.shard_bytes)
                if self.fsync:
                    self.io.fsync(fd)
                return True
            self.io.close(fd)  # renamed or removed under us: start over on the new file
        raise OSError(errno.EAGAIN, f"{self.part} keeps changing under this writer")

    def arrive(self, shard: int) -> bool:
        """Flag the shard; the writer that completes the block renames it into place (and
        gets True)."""
        fd = self.fd
        self.io.write_from(fd, memoryview(b"\x01"), self.data_bytes + shard)
        fcntl.flock(fd, fcntl.LOCK_UN)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not _same_file(fd, self.part):
            return False  # another writer completed it
        flags = os.pread(fd, self.num_shards, self.data_bytes)
        if len(flags) == self.num_shards and all(flags):
            os.ftruncate(fd, self.data_bytes)
            if self.fsync:
                self.io.fsync(fd)
            self.io.rename(self.part, self.final)
            return True
        return False

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            self.io.close(fd)  # closing drops the flock
