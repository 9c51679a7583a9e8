"""File layout and atomic writes of the posix store.

Layout: ``<dir>/<xyz>/<32 hex digits of the id>``, where ``<dir>`` is one of the backend
directories (chosen by the id's first two bytes) and ``<xyz>`` the id's first three hex
digits (up to 4096 prefix directories per backend directory, each made by the first
write that needs it). A block file holds its shards
at fixed offsets: shard ``k`` at ``k * shard_bytes``, then a *trailer*: ``MAGIC`` and one
little-endian 8-byte xxh3 digest per shard (``kvfabric.platform.checksum``), computed by
the shard's writer from the bytes it wrote. The trailer is padded to ``ALIGN`` when the
shard size is a multiple of ``ALIGN`` (so O_DIRECT reads and writes of data plus trailer
stay aligned), else it is ``8 + 8 * num_shards`` bytes. The file's size is exactly
``num_shards * shard_bytes + trailer_bytes``: a file of any other size (truncated, or
written before trailers existed) is corrupt. The checksum lives in the file, not in an
xattr, because it then travels with the bytes through every rename, copy and file system
(tmpfs, NFS and Lustre differ on user xattrs) and is read by the same ``preadv``.

Atomicity (no torn block is ever visible, whoever dies when):

* One shard per block: the writer writes ``<id>.<host>.<pid>.<n>.tmp`` next to the final
  name and renames it into place once complete. A writer killed before the rename leaves
  only a ``.tmp`` file, which maintenance removes (at once when its pid is dead on this
  host, else after ``tmp_ttl``).
* Several shards per block (written by different calls, possibly different processes):
  writers share ``<id>.part``, sized ``num_shards * shard_bytes + trailer_bytes +
  num_shards``; the last bytes are arrival flags. A writer takes a shared ``flock``,
  checks the file is still the current ``.part`` (same inode), writes its shard and its
  digest in the trailer, then sets its flag; then under an exclusive lock, whoever sees
  every flag set writes ``MAGIC``, truncates the flags away and renames the file into
  place. A shard written but not flagged is simply rewritten (digest included) by the
  next writer of that shard.

``FileIO`` wraps the system calls so tests can inject ENOSPC, I/O errors and stalls.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import socket
import struct
from collections.abc import Sequence

import numpy as np

from kvfabric.errors import KVFabricError
from kvfabric.ucm_layer.hashing import to_hex

PREFIX_DIGITS = 3
PREFIX_DIRS = 16**PREFIX_DIGITS  # 4096
ALIGN = 4096  # O_DIRECT alignment of offsets, sizes and memory
MAGIC = b"KVFSUM01"  # the trailer's first bytes (format version 1: xxh3-64 per shard)
log = logging.getLogger("kvfabric.store.posix")

HOST = socket.gethostname().replace(".", "_") or "host"
_counter = itertools.count()


def trailer_bytes(num_shards: int, shard_bytes: int) -> int:
    """Bytes of a block file's trailer (see module docstring)."""
    meta = len(MAGIC) + 8 * num_shards
    return -(-meta // ALIGN) * ALIGN if shard_bytes % ALIGN == 0 else meta


def pack_trailer(digests: Sequence[int], size: int) -> bytes:
    """A trailer of ``size`` bytes holding ``digests`` (one per shard, in shard order)."""
    body = MAGIC + struct.pack(f"<{len(digests)}Q", *digests)
    return body + bytes(size - len(body))


def trailer_digest(trailer: bytes | memoryview, shard: int) -> int:
    """The digest a trailer records for ``shard``; 0 (none) when it is not a trailer."""
    if bytes(trailer[: len(MAGIC)]) != MAGIC or len(trailer) < len(MAGIC) + 8 * (shard + 1):
        return 0
    return int(struct.unpack_from("<Q", trailer, len(MAGIC) + 8 * shard)[0])


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


class DirectoryUnusable(KVFabricError):
    """A backend directory of the posix store cannot hold block files (not a directory,
    read-only, no permission, full): raised at start so the engine does not serve with a
    store whose every save would fail."""


def check_writable(directory: str) -> None:
    """Create, write one ``ALIGN`` page to and remove a probe file in ``directory``, or raise
    :class:`DirectoryUnusable` naming the directory and the system's reason."""
    probe = os.path.join(directory, f".kvf-write-probe.{HOST}.{os.getpid()}.{next(_counter)}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if os.write(fd, bytes(ALIGN)) != ALIGN:
                raise OSError(errno.ENOSPC, "short write")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise DirectoryUnusable(
            f"posix store: directory {directory!r} cannot be written ({e}): every save would fail; "
            "fix posix.dirs (a writable directory with free space) before starting"
        ) from e


def probe_direct(dirs: Sequence[str]) -> bool:
    """Whether every directory's file system accepts O_DIRECT."""
    for d in dirs:
        probe = os.path.join(d, f".kvf-direct-probe.{os.getpid()}")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
            os.close(fd)
        except OSError as e:
            log.warning("posix.direct: %s does not accept O_DIRECT (%s); using buffered I/O", d, e)
            return False
        finally:
            try:
                os.unlink(probe)
            except OSError:
                pass
    return True


class BlockFiles:
    """Where each block's file lives (see module docstring)."""

    def __init__(self, dirs: Sequence[str]) -> None:
        self.dirs = tuple(os.path.join(d, "") for d in dirs)  # with a trailing separator
        for d in self.dirs:
            try:
                os.makedirs(d, exist_ok=True)  # prefix directories are made on first write
            except OSError as e:
                raise DirectoryUnusable(f"posix store: cannot make directory {d!r}: {e}") from e
            check_writable(d)

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


def write_single(
    io: FileIO, final: str, view: memoryview, direct: bool, fsync: bool, trailer: bytes | None = None
) -> str:
    """Write a one-shard block (``view``, then ``trailer`` unless ``view`` already ends with
    it) to a fresh temporary file; return its name (not yet visible). On failure the
    temporary file is removed and the error raised."""
    tmp = BlockFiles.tmp_name(final)
    try:
        fd = io.open_new(tmp, direct)
    except FileNotFoundError:  # first block of this prefix directory
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        fd = io.open_new(tmp, direct)
    try:
        io.write_from(fd, view, 0)
        if trailer is not None:
            io.write_from(fd, memoryview(trailer), len(view))
        if fsync:
            io.fsync(fd)
    except BaseException:
        io.close(fd)
        io.unlink(tmp)
        raise
    io.close(fd)
    return tmp


def same_file(fd: int, path: str) -> bool:
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
        self.trailer_bytes = trailer_bytes(num_shards, shard_bytes)
        self.fd = -1

    @property
    def data_bytes(self) -> int:
        return self.num_shards * self.shard_bytes

    @property
    def file_bytes(self) -> int:
        """The size of the finished block file (data and trailer)."""
        return self.data_bytes + self.trailer_bytes

    def write(self, shard: int, view: memoryview, digest: int) -> bool:
        """Write shard data and its digest (not flagged yet). False when the block got
        complete meanwhile."""
        for _ in range(100):
            if os.access(self.final, os.F_OK):
                return False
            try:
                fd = self.io.open_part(self.part)
            except FileNotFoundError:  # first block of this prefix directory
                os.makedirs(os.path.dirname(self.part), exist_ok=True)
                fd = self.io.open_part(self.part)
            fcntl.flock(fd, fcntl.LOCK_SH)
            if same_file(fd, self.part):
                self.fd = fd
                self.io.write_from(fd, view, shard * self.shard_bytes)
                self.io.write_from(
                    fd, memoryview(struct.pack("<Q", digest)), self.data_bytes + len(MAGIC) + 8 * shard
                )
                if self.fsync:
                    self.io.fsync(fd)
                return True
            self.io.close(fd)  # renamed or removed under us: start over on the new file
        raise OSError(errno.EAGAIN, f"{self.part} keeps changing under this writer")

    def arrive(self, shard: int) -> bool:
        """Flag the shard; the writer that completes the block renames it into place (and
        gets True)."""
        fd = self.fd
        self.io.write_from(fd, memoryview(b"\x01"), self.file_bytes + shard)
        fcntl.flock(fd, fcntl.LOCK_UN)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not same_file(fd, self.part):
            return False  # another writer completed it
        flags = os.pread(fd, self.num_shards, self.file_bytes)
        if len(flags) == self.num_shards and all(flags):
            self.io.write_from(fd, memoryview(MAGIC), self.data_bytes)
            os.ftruncate(fd, self.file_bytes)
            if self.fsync:
                self.io.fsync(fd)
            self.io.rename(self.part, self.final)
            return True
        return False

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            self.io.close(fd)  # closing drops the flock
