"""CPU contention for liveness tests: busy-loop processes, and a GIL held in one long C call.

* ``CpuHog(n)``: a context manager that starts ``n`` busy-loop Python processes (same
  niceness as the tests) and, on exit, kills each one by its pid and reaps it, also when
  the body raised. A hog also ends by itself when its parent is gone or after
  ``lifetime`` seconds, so a test run killed with -9 leaves no busy loop behind.
* ``hold_gil(seconds, busy=True)``: hold this interpreter's GIL in one C call, so no other
  thread of the process (heartbeat, reader, monitor) runs meanwhile. ``busy``: on a CPU,
  the builtin ``sum`` over a ``range`` (it never releases the GIL), sized to ``seconds`` of
  work at the best speed measured here, so about that long or more on a loaded machine;
  otherwise blocked in the kernel, ``nanosleep`` called through ``ctypes.PyDLL`` (which
  keeps the GIL), exactly ``seconds``, as an extension waiting on a device with the GIL
  held would. Returns the wall seconds held.
* ``busy_python(seconds)``: a pure-Python loop for ``seconds`` (the GIL changes hands
  every switch interval); returns the iterations done.
* ``background_hog_from_env()``: what ``tests/sim/conftest.py`` wraps the sim tier in:
  with ``KVFABRIC_TEST_CPU_HOG=1`` a ``CpuHog`` of ``KVFABRIC_TEST_CPU_HOG_PROCS``
  processes (default: two per core) runs for the whole test session; otherwise nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Iterator

_HOG = """
import os, sys, time
parent, end = os.getppid(), time.monotonic() + float(sys.argv[1])
while os.getppid() == parent and time.monotonic() < end:
    for _ in range(200000):
        pass
"""

_CHUNK = 1_000_000  # sum(range(_CHUNK)) takes a millisecond or two: the calibration unit of hold_gil
_MAX_TERMS = 4_000_000_000  # sum(range(n)) stays a machine-word sum (fast path, no release) below this


class CpuHog:
    """``n`` busy-loop processes for the duration of a ``with`` block (see module docstring)."""

    def __init__(self, n: int | None = None, lifetime: float = 600.0) -> None:
        self.n = 2 * (os.cpu_count() or 1) if n is None else n
        if self.n < 1:
            raise ValueError(f"a CpuHog needs at least one process, got {self.n}")
        self.lifetime = lifetime
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> CpuHog:
        try:
            for _ in range(self.n):
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _HOG, str(self.lifetime)],
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                    )
                )
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def running(self) -> int:
        """How many hog processes are still busy."""
        return sum(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        """Kill every hog by its pid and reap it. Idempotent."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        self.procs.clear()


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def hold_gil(seconds: float, busy: bool = True) -> float:
    """Hold the GIL for about ``seconds`` in one C call (see module docstring)."""
    if not busy:
        ts = _Timespec(int(seconds), int((seconds % 1) * 1e9))
        t0 = time.monotonic()
        ctypes.PyDLL(None).nanosleep(ctypes.byref(ts), None)
        return time.monotonic() - t0
    runs = []
    for _ in range(10):  # the fastest run is the true cost: slower ones were preempted
        t0 = time.perf_counter()
        sum(range(_CHUNK))
        runs.append(time.perf_counter() - t0)
    per_term = max(min(runs) / _CHUNK, 1e-10)
    n = min(int(seconds / per_term), _MAX_TERMS)
    t0 = time.monotonic()
    sum(range(n))
    return time.monotonic() - t0


def busy_python(seconds: float) -> int:
    """Spin in Python bytecode for ``seconds``; the iterations done."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return n


@contextlib.contextmanager
def background_hog_from_env() -> Iterator[CpuHog | None]:
    """A session-long ``CpuHog`` when ``KVFABRIC_TEST_CPU_HOG=1`` (see module docstring)."""
    flag = os.environ.get("KVFABRIC_TEST_CPU_HOG", "0").strip().lower()
    if flag in ("", "0", "off", "no", "false"):
        yield None
        return
    if flag not in ("1", "on", "yes", "true"):
        raise ValueError(f"KVFABRIC_TEST_CPU_HOG must be 1 or 0, got {flag!r}")
    procs = os.environ.get("KVFABRIC_TEST_CPU_HOG_PROCS")
    try:
        n = None if procs is None else int(procs)
    except ValueError:
        raise ValueError(f"KVFABRIC_TEST_CPU_HOG_PROCS must be an integer, got {procs!r}") from None
    with CpuHog(n, lifetime=24 * 3600.0) as hog:
        yield hog
