"""Staging buffers of the remote transport's bounded reads.

A read from another rank that must return within ``GvaConfig.remote_read_timeout`` cannot
let the engine write into the caller's memory: a copy cannot be recalled, so a transfer
given up at the deadline may still land later, into memory the caller has reused by then
(a torn or foreign object in a KV cache). The engine therefore reads into a staging
buffer the transport owns, and the bytes are copied to the caller only once the engine
reported the whole transfer complete. A transfer given up keeps its staging buffers
until the engine reports it final (``RemoteTransport`` polls it); only then do they come
back here, so late bytes land in memory nobody reads.

Contract: ``take(medium, nbytes)`` hands out a platform buffer of ``medium`` of at least
``nbytes`` bytes, registered with the engine (the ``register`` callback); ``give(buf)``
returns it (the caller must be sure no transfer still targets it). Free buffers are kept
by size class (powers of two from ``MIN_BYTES``) up to ``keep_bytes`` in all; beyond that
a returned buffer is unregistered (``forget``) and freed. ``close()`` frees the free
ones and returns how many buffers are still out. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvfabric.platform.base import Platform
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.types import Medium

MIN_BYTES = 64 << 10  # the smallest staging buffer
KEEP_BYTES = 256 << 20  # free staging memory kept for reuse, all media together


def size_class(nbytes: int) -> int:
    """The buffer size a request of ``nbytes`` gets: the next power of two, at least ``MIN_BYTES``."""
    if nbytes <= MIN_BYTES:
        return MIN_BYTES
    return 1 << (int(nbytes) - 1).bit_length()


class StagingPool:
    """Registered buffers bounded reads land in (see module docstring)."""

    def __init__(
        self,
        platform: Platform,
        register: Callable[[Buffer], None],
        forget: Callable[[Buffer], None],
        keep_bytes: int = KEEP_BYTES,
    ) -> None:
        self.platform = platform
        self._register = register
        self._forget = forget
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._free: dict[tuple[Medium, int], list[Buffer]] = {}
        self._kept = 0  # bytes in ``_free``
        self._out = 0  # buffers handed out and not given back

    def take(self, medium: Medium, nbytes: int) -> Buffer:
        """A registered buffer of ``medium`` holding at least ``nbytes`` bytes."""
        size = size_class(nbytes)
        with self._lock:
            free = self._free.get((medium, size))
            if free:
                self._kept -= size
                self._out += 1
                return free.pop()
        buf = self.platform.alloc(size, medium)
        try:
            self._register(buf)
        except BaseException:
            self.platform.free(buf)
            raise
        with self._lock:
            self._out += 1
        return buf

    def give(self, buf: Buffer) -> None:
        """Take ``buf`` back; no transfer may still target it."""
        with self._lock:
            self._out -= 1
            if self._kept + buf.nbytes <= self.keep_bytes:
                self._free.setdefault((buf.medium, buf.nbytes), []).append(buf)
                self._kept += buf.nbytes
                return
        self._release(buf)

    def _release(self, buf: Buffer) -> None:
        try:
            self._forget(buf)
        finally:
            self.platform.free(buf)

    def close(self) -> int:
        """Free every buffer not handed out; how many are still out (held by transfers
        the engine has not reported final: they are left to the process's end)."""
        with self._lock:
            bufs = [b for free in self._free.values() for b in free]
            self._free.clear()
            self._kept = 0
            out = self._out
        for b in bufs:
            self._release(b)
        return out
