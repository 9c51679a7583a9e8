"""How busy the machine was during a measurement, and how much of that was not us.

A figure taken while other work ran on the machine means something else than one taken
on a quiet machine: a cross-process wake-up costs several times more when the peer's core
is idle than when it is busy, and a busy core steals time from the client. ``CpuMeter``
samples ``/proc/stat`` (all CPUs) and the CPU time of the benchmark's own processes (the
root process and its descendants: clients, daemon, peer servers), and reports

* ``cpu_busy``: the machine's busy fraction over the interval (0..1, all cores);
* ``foreign_cores``: cores' worth of CPU used by anything that is not the benchmark
  (other users, and the deliberate spinner of an ``other-core-busy`` case);
* ``other_core``: ``"idle"`` when ``foreign_cores`` < 0.15, else ``"busy"``
  (``"unknown"`` without ``/proc`` or for an interval shorter than a clock tick).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

IDLE_FOREIGN_CORES = 0.15


def _stat_total() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs."""
    try:
        with open("/proc/stat") as f:
            row = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = row[3] + (row[4] if len(row) > 4 else 0)
    total = sum(row[:8])  # user..steal; guest time is already inside user
    return total - idle, total


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, utime + stime) of ``pid`` in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    rest = data.rpartition(")")[2].split()
    try:
        return int(rest[1]), int(rest[11]) + int(rest[12])
    except (IndexError, ValueError):
        return None


def tree_cpu_ticks(root: int, exclude: frozenset[int] = frozenset()) -> int:
    """CPU ticks used so far by ``root`` and its live descendants (minus ``exclude`` and
    theirs)."""
    stats: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            s = _proc_stat(int(name))
            if s is not None:
                stats[int(name)] = s
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in exclude or pid not in stats:
            continue
        total += stats[pid][1]
        todo += children.get(pid, [])
    return total


@dataclass(frozen=True)
class CpuSample:
    wall: float
    busy: int
    total: int
    ours: int


class CpuMeter:
    """``start()`` then ``stop() -> fields``; ``exclude``: pids counted as foreign."""

    def __init__(self, root: int | None = None, exclude: frozenset[int] = frozenset()) -> None:
        self.root = root or os.getpid()
        self.exclude = exclude
        self._a: CpuSample | None = None
        self.ncpu = os.cpu_count() or 1

    def _sample(self) -> CpuSample | None:
        st = _stat_total()
        if st is None:
            return None
        return CpuSample(time.monotonic(), st[0], st[1], tree_cpu_ticks(self.root, self.exclude))

    def start(self) -> CpuMeter:
        self._a = self._sample()
        return self

    def stop(self) -> dict[str, Any]:
        a, b = self._a, self._sample()
        if a is None or b is None or b.total <= a.total:  # no /proc, or shorter than a tick
            return {"cpu_busy": None, "foreign_cores": None, "other_core": "unknown"}
        total = b.total - a.total
        per_cpu_ticks = total / self.ncpu
        busy = (b.busy - a.busy) / total
        foreign = max(0.0, (b.busy - a.busy) - (b.ours - a.ours)) / per_cpu_ticks
        return {
            "cpu_busy": round(busy, 2),
            "foreign_cores": round(foreign, 2),
            "other_core": "idle" if foreign < IDLE_FOREIGN_CORES else "busy",
        }


def spin_forever() -> None:  # pragma: no cover - runs in a child process until killed
    """Keep one core busy (the ``other-core-busy`` condition)."""
    while True:
        pass
