"""Block-file integrity of the posix store: sealing a shard's trailer, checking a load's
digest against it, and dropping a file that fails.

Every block file ends with a trailer of per-shard xxh3 digests (layout: ``posix_files.py``),
computed by each shard's writer over the bytes it wrote (on the host: the caller's host
memory or the bounce area). With ``posix.verify`` on, a load reads the shard in runs of
``checksum.SEGMENT`` bytes and hashes each run while it is still in cache, then compares
with the trailer (read by the same ``preadv`` for one-shard blocks). A mismatch, or a file
of the wrong size, is ``CORRUPT``: counted, logged once, the file is removed (so the next
dump writes it again). Its destination may hold the bad bytes (the bounce path hashes the
bounce area while the copy to the caller runs): like any failure, it must not be used.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from kvfabric.platform.checksum import digest_range
from kvfabric.ucm_layer.store.base import BlockStatus
from kvfabric.ucm_layer.store.posix_files import pack_trailer, trailer_digest

OK, CORRUPT = BlockStatus.OK, BlockStatus.CORRUPT

Ident = tuple[int, int]  # a file's (device, inode), to drop only the file that was read


class Integrity:
    """The checks of one posix store. ``unlink(path)``: the store's file removal;
    ``verifying()``: whether loads check now (the store's
    ``verify``, switched by ``set_verify``); ``warn(kind, msg, *args)`` logs once per kind;
    ``corrupt_found(count, where)`` counts and reports blocks that failed (the store's)."""

    def __init__(
        self,
        unlink: Callable[[str], None],
        verifying: Callable[[], bool],
        stride: int,
        trailer_bytes: int,
        warn: Callable[..., None],
        corrupt_found: Callable[[int, str], None],
    ) -> None:
        self._unlink, self.stride, self.trailer_bytes = unlink, stride, trailer_bytes
        self._verifying = verifying
        self._warn, self._corrupt_found = warn, corrupt_found

    @property
    def on(self) -> bool:
        return self._verifying()

    def buffer(self) -> memoryview | None:
        """A trailer buffer for a read, or None when verify is off (no trailer is read)."""
        return memoryview(bytearray(self.trailer_bytes)) if self.on else None

    def trailer(self, digest: int) -> bytes:
        """The trailer of a one-shard block whose shard digests to ``digest``."""
        return pack_trailer([digest], self.trailer_bytes)

    def seal(self, bounce: np.ndarray, base: int, digest: int) -> memoryview:
        """Write the trailer after the shard at ``base`` of a bounce area; return shard and
        trailer as one (O_DIRECT-able) view."""
        end = base + self.stride + self.trailer_bytes
        bounce[base + self.stride : end] = np.frombuffer(self.trailer(digest), np.uint8)
        return memoryview(bounce[base:end])

    def slot_digests(self, bases: np.ndarray) -> list[int]:
        """The shard digests of bounce slots at ``bases`` (none when verify is off)."""
        return [digest_range(int(b), self.stride) for b in bases.tolist()] if self.on else []

    def checked(
        self, st: BlockStatus, got: int, trailer: memoryview | None, shard: int, path: str, ident: Ident
    ) -> BlockStatus:
        """``st`` of a read whose shard bytes digest to ``got``, against its trailer."""
        if st is not OK or trailer is None or got == trailer_digest(trailer, shard):
            return st
        return self.drop(path, ident, f"{path} (shard {shard})")

    def drop(self, path: str, ident: Ident, what: str) -> BlockStatus:
        """A block file that failed verification: remove it (unless it was replaced since it
        was read) so the next dump writes it again; count and report it."""
        try:
            st = os.stat(path)
            if (st.st_dev, st.st_ino) == ident:
                self._unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._warn("drop", "posix store: cannot remove corrupt block file %s: %s", path, e)
        self._corrupt_found(1, what)
        return CORRUPT
