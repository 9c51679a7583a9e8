"""Faults planted into stores by the conformance suite and the store tests: stalled and
failing copies, flipped bytes where a tier keeps a block, posix I/O that stalls, crawls
or runs out of disk, and a child process that dumps until it is killed."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import numpy as np
from stores import LAYOUT, Blocks, block_bytes, build_store, random_ids, tier

from kvfabric.platform.base import Platform
from kvfabric.ucm_layer.store.base import Store
from kvfabric.ucm_layer.store.posix_files import FileIO


def stall_pool_copies(store: Store, marker: str) -> None:
    """Make the pool store's next copy into the pool write half its pieces, drop
    ``marker`` and hang (the test then kills the process mid-dump)."""
    dp = store.client.dp  # type: ignore[attr-defined]
    real = dp.write

    def half_then_hang(gvas, srcs, sizes):
        k = max(1, len(gvas) // 2)
        real(gvas[:k], srcs[:k], sizes[:k])
        Path(marker).write_text("stalled")
        while True:
            time.sleep(1)

    dp.write = half_then_hang


def posix_tier(store: Store) -> Store | None:
    """The posix store inside ``store`` (itself, or a pipeline's lower tier), if any."""
    for s in (store, getattr(store, "lower", None)):
        if s is not None and s.name == "posix":
            return s
    return None


# ---------------------------------------------------------------------------- planted corruption
FLIP_AT = 100  # the byte of a shard that ``plant_flip`` inverts (inside the first piece)


def plant_flip(store: Store, block_id: np.ndarray, shard: int = 0, at: int = FLIP_AT) -> None:
    """Invert one byte of shard ``shard`` of ``block_id`` where ``store`` (one tier, not a
    pipeline) keeps it, leaving every size as it was: in the block file on disk (posix), in
    the slot's memory (cache), in the pool's window (pool)."""
    import ctypes

    from kvfabric.ucm_layer.store.cache_index import keys_of

    ids = np.ascontiguousarray(block_id.reshape(1, 16))
    if store.name == "posix":
        path = store.files.paths(ids)[0]  # type: ignore[attr-defined]
        with open(path, "r+b") as f:
            f.seek(shard * store.layout.shard_bytes + at)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
        return
    if store.name == "cache":
        slot = store.table.index[int(keys_of(ids, shard)[0])]  # type: ignore[attr-defined]
        ptr = store.buffer.ptr + slot * store.slot_bytes + at  # type: ignore[attr-defined]
    elif store.name == "pool":
        client = store.client  # type: ignore[attr-defined]
        key = store.keys(ids, shard)[0]  # type: ignore[attr-defined]
        i, (_seq, gva, size, _gen, _state, _exp, _csum) = client.table.lookup_raw(key)
        assert i >= 0, f"pool key {key!r} not found"
        local = client.dp.local(gva, size)
        assert local is not None and local[1], "the pool object is not in host memory mapped here"
        ptr = local[0] + at
    else:
        raise ValueError(f"no way to plant corruption in store {store.name!r}")
    byte = ctypes.c_ubyte.from_address(int(ptr))
    byte.value ^= 0xFF


# ---------------------------------------------------------------------------- block data
def fail_copies(plat: Platform, count: int = 100000) -> None:
    """Make the next ``count`` copies fail on a platform with fault injection (else skip)."""
    if hasattr(plat, "faults"):
        plat.faults.fail_copy(nth=1, count=count)
    elif hasattr(getattr(plat, "runtime", None), "fail_next_copy"):
        plat.runtime.fail_next_copy(count)
    else:
        import pytest

        pytest.skip(f"{plat!r} has no fault injection")


def clear_faults(plat: Platform) -> None:
    if hasattr(plat, "faults"):
        plat.faults.clear()
    elif hasattr(getattr(plat, "runtime", None), "fail_copies"):
        plat.runtime.fail_copies = 0


def blocked_event(plat: Platform, seconds: float) -> tuple:
    """``(stream, event)``: an event that completes only after ``seconds`` (sim: a stalled
    stream), or only once the stream is synchronized (the fake device runtime, which runs
    queued copies only when waited on). Skips on real hardware."""
    from kvfabric.platform.types import Medium as M

    s = plat.stream()
    if hasattr(plat, "stall"):
        plat.stall(s, seconds)
    elif type(getattr(plat, "runtime", None)).__name__ == "HostRuntime":
        a, b = plat.alloc(4096, M.DRAM), plat.alloc(4096, M.HBM)
        plat.copy(b, a, stream=s)
    else:
        import pytest

        s.close()
        pytest.skip(f"{plat!r} cannot hold an event back")
    ev = plat.event()
    ev.record(s)
    return s, ev


# ---------------------------------------------------------------------------- posix I/O faults
class StallingIO(FileIO):
    """Writes half of a block file, drops a marker file, then stalls (until ``release``).
    Writes of at most ``SMALL`` bytes (checksum trailers, digests, arrival flags) never
    stall and do not count as blocks."""

    SMALL = 64

    def __init__(self, marker: str, after_blocks: int = 0) -> None:
        self.marker, self.after_blocks = marker, after_blocks
        self.release = threading.Event()
        self._writes = 0
        self._lock = threading.Lock()

    def write_from(self, fd: int, view: memoryview, offset: int) -> None:
        if len(view) <= self.SMALL:
            return super().write_from(fd, view, offset)
        with self._lock:
            self._writes += 1
            stall = self._writes > self.after_blocks and len(view) > self.SMALL
        if not stall:
            return super().write_from(fd, view, offset)
        half = len(view) // 2
        super().write_from(fd, view[:half], offset)
        Path(self.marker).touch()
        self.release.wait()
        super().write_from(fd, view[half:], offset + half)


class SlowReadIO(FileIO):
    """Every read (one buffer or scattered) waits until ``release`` is set (then completes
    normally)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()

    def read_into(self, fd: int, view: memoryview, offset: int) -> None:
        self.started.set()
        self.release.wait()
        super().read_into(fd, view, offset)

    def read_scatter(self, fd: int, views: list[memoryview], offset: int) -> None:
        self.started.set()
        self.release.wait()
        super().read_scatter(fd, views, offset)


class FullDiskIO(FileIO):
    """A file system that runs out of space after ``budget`` bytes of writes (ENOSPC)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._lock = threading.Lock()

    def write_from(self, fd: int, view: memoryview, offset: int) -> None:
        with self._lock:
            if len(view) > self.budget:
                self.budget = 0
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.budget -= len(view)
        super().write_from(fd, view, offset)


# ---------------------------------------------------------------------------- child process
def child_dump_forever(
    spec: str, root: str, env: dict, seed: int, n: int, stall: bool, platform: str = "sim"
) -> None:
    """Child: dump ``n`` blocks of ``random_ids(n, seed)`` again and again under fresh ids
    derived from a round counter; with ``stall``, the posix tier stalls mid-file after the
    first two blocks and drops ``root/stalled``. Runs until killed."""
    os.environ.update(env)
    from platforms import build

    plat = build(platform)
    store = build_store(spec, root, plat)
    if stall:
        posix = posix_tier(store)
        if posix is not None:
            posix.io = StallingIO(os.path.join(root, "stalled"), after_blocks=2)
        else:
            stall_pool_copies(tier(store, "pool"), os.path.join(root, "stalled"))
    blocks = Blocks(plat, LAYOUT, n)
    for r in range(10**6):
        ids = random_ids(n, seed + r)
        blocks.write(block_bytes(ids, LAYOUT.shard_bytes))
        store.wait(store.dump(ids, 0, blocks.addrs))
        Path(os.path.join(root, "progress")).write_text(str(r))
        time.sleep(0.001)
