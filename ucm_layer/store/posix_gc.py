"""Capacity and maintenance of the posix store: usage, GC of the coldest blocks, stale temps.

A block file's mtime is its hotness clock (loads touch it). One background thread per
store instance scans the backend directories at start and then every ``interval``
seconds, or at once when a writer signals that usage crossed the high watermark or that
a write hit ENOSPC. A scan:

* adds up the size of every block file (other processes' writes included);
* when ``capacity`` is set and usage is above ``high * capacity``, removes the files with
  the oldest mtimes until usage is at most ``low * capacity``;
* removes temporary files of writers that are dead (same host, pid gone) or older than
  ``tmp_ttl``, and ``.part`` files untouched for ``tmp_ttl`` that no writer holds.

Removing a block under a reader is safe: the reader's open descriptor keeps the inode;
a later load of that block reports ``MISSING``. Several processes may collect the same
directories; a file already gone is skipped.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvfabric.platform.shm import process_alive
from kvfabric.ucm_layer.store.posix_files import HOST, PREFIX_DIRS

log = logging.getLogger("kvfabric.store.posix")

ID_HEX = 32


@dataclass(frozen=True)
class GcReport:
    """What one scan found and did."""

    files: int
    usage_bytes: int
    removed_blocks: int
    removed_bytes: int
    removed_temps: int


def _stale_tmp(name: str, mtime: float, now: float, ttl: float) -> bool:
    """``<id>.<host>.<pid>.<n>.tmp``: stale if its writer is dead here, or it is too old."""
    parts = name.split(".")
    if len(parts) == 5 and parts[1] == HOST:
        try:
            if not process_alive(int(parts[2])):
                return True
        except ValueError:
            pass
    return now - mtime > ttl


class Collector:
    """Usage accounting and the maintenance thread of one posix store."""

    def __init__(
        self,
        dirs: Sequence[str],
        capacity: int,
        high: float,
        low: float,
        interval: float,
        tmp_ttl: float,
        background: bool = True,
    ) -> None:
        self.dirs = tuple(dirs)
        self.capacity, self.high, self.low = capacity, high, low
        self.interval, self.tmp_ttl = interval, tmp_ttl
        self._usage = 0
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.last: GcReport | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._main, name="kvfabric-posix-gc", daemon=True)
            self._thread.start()

    @property
    def usage(self) -> int:
        return self._usage

    def added(self, nbytes: int) -> None:
        """A writer made ``nbytes`` of block files visible."""
        with self._lock:
            self._usage += nbytes
            over = self.capacity and self._usage > self.high * self.capacity
        if over:
            self._wake.set()

    def out_of_space(self) -> None:
        """A write hit ENOSPC: collect now (with no capacity set, only temps go)."""
        self._wake.set()

    def _main(self) -> None:
        while not self._stop.is_set():
            try:
                self.collect()
            except Exception as e:  # noqa: BLE001 - maintenance must not die
                log.warning("posix store maintenance failed: %s", e)
            # without a capacity only temps need sweeping: at start and after ENOSPC
            self._wake.wait(self.interval if self.capacity else None)
            self._wake.clear()

    def collect(self) -> GcReport:
        """One scan (see module docstring); safe to call from any thread."""
        with self._scan_lock:
            report = self._scan()
        self.last = report
        return report

    def _scan(self) -> GcReport:
        now = time.time()
        blocks: list[tuple[int, int, str]] = []  # (mtime_ns, size, path)
        temps = 0
        for d in self.dirs:
            for i in range(PREFIX_DIRS):
                sub = os.path.join(d, f"{i:03x}")
                try:
                    it = os.scandir(sub)
                except FileNotFoundError:
                    continue
                with it:
                    for e in it:
                        temps += self._visit(e, blocks, now)
        usage = sum(b[1] for b in blocks)
        removed = removed_bytes = 0
        if self.capacity and usage > self.high * self.capacity:
            target = self.low * self.capacity
            blocks.sort()
            for _, size, path in blocks:
                if usage <= target:
                    break
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                usage -= size
                removed += 1
                removed_bytes += size
            if removed:
                log.info("posix store GC removed %d coldest block(s), %d B", removed, removed_bytes)
        with self._lock:
            self._usage = usage
        return GcReport(len(blocks) - removed, usage, removed, removed_bytes, temps)

    def _visit(self, e: os.DirEntry, blocks: list[tuple[int, int, str]], now: float) -> int:
        name = e.name
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            return 0
        if len(name) == ID_HEX:
            blocks.append((st.st_mtime_ns, st.st_size, e.path))
            return 0
        if name.endswith(".tmp") and _stale_tmp(name, st.st_mtime, now, self.tmp_ttl):
            return _remove(e.path)
        if name.endswith(".part") and now - st.st_mtime > self.tmp_ttl:
            return _remove_unlocked_part(e.path)
        return 0

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()


def _remove(path: str) -> int:
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0


def _remove_unlocked_part(path: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return 0
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return 0  # a writer holds it
    try:
        return _remove(path)
    finally:
        os.close(fd)
