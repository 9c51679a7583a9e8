"""The sparse backend's counters as a JSON file, written off the forward path.

Writing a file (open, write, rename) costs 0.2-0.4 ms on this kind of machine, a few
percent of a decode step at long context and far more at short ones. The worker's forward
only hands over a snapshot; a daemon thread writes it.

Contract: :meth:`StatsFile.publish` (forward thread, once per step) keeps the mapping, which
the caller does not touch again, and wakes the writer. The writer writes the latest mapping
published (older unwritten ones are skipped) as one whole file (a temporary file renamed over
``path``, so a reader never sees a torn one), then waits ``interval_s`` before the next write:
the file is at most one write behind the steps, and current within about ``interval_s`` of
the last step. :meth:`close` (also run at interpreter exit) writes the latest mapping on the
caller's thread and stops the writer. A write that fails (a removed directory, a full disk)
is logged once and retried with the next snapshot; it never reaches the forward.

Memory: one mapping held. Threads: the forward thread publishes, one writer writes; writes
are serialised by a lock (the writer's and ``close``'s).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from typing import Any

log = logging.getLogger("kvfabric.sparse")


class StatsFile:
    """``path`` rewritten with the latest published counters (see the module docstring)."""

    def __init__(self, path: str, interval_s: float = 0.25) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.path, self.interval_s = path, interval_s
        self._latest: dict[str, Any] | None = None
        self._written: dict[str, Any] | None = None
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="kvfabric-sparse-stats", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def publish(self, snapshot: dict[str, Any]) -> None:
        """The step's counters (the caller gives the mapping away)."""
        self._latest = snapshot
        self._wake.set()

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait()
            self._wake.clear()
            if self._closed.is_set():
                return
            self._write()
            self._closed.wait(self.interval_s)  # coalesce the snapshots of the next interval

    def _write(self) -> None:
        with self._lock:
            snap = self._latest
            if snap is None or snap is self._written:
                return
            tmp = f"{self.path}.{os.getpid()}.tmp"
            try:
                with open(tmp, "w") as f:
                    json.dump(snap, f)
                os.replace(tmp, self.path)
            except OSError as e:
                if not self._warned:
                    log.warning("kvfabric sparse: cannot write the stats file %s: %s", self.path, e)
                    self._warned = True
                return
            self._written = snap

    def close(self) -> None:
        """Write the latest counters now and stop the writer (idempotent)."""
        self._closed.set()
        self._wake.set()
        self._write()
        atexit.unregister(self.close)


__all__ = ["StatsFile"]
