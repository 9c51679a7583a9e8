"""A benchmark client process of ``kvfabric bench pool``: buffers, timed calls, memcpy.

Started by :class:`kvfabric.bench.poolrunner.Runner` (``multiprocessing`` spawn). It opens a
store driver, allocates two buffers of ``capacity`` bytes — ``user`` (the caller memory
objects are put from and got into) and ``scratch`` (the other side of the memcpy
baseline) — writes every page of both (so no figure pays page faults) and registers them
with the store. Then it answers the host's commands over a pipe:

* ``("warm", nbytes)``: put and remove ``nbytes`` of 4 MiB objects (faults the store's
  memory in, as a running system's would be);
* ``("calibrate", case, client_bytes)``: store the case's objects if it reads them, run two
  untimed calls (removing what they put), reply ``(seconds of the second, failures, why)``;
* ``("measure", case, client_bytes, calls, rounds, together)``: ``rounds`` rounds of
  ``calls`` calls, each followed by a memcpy of the same bytes between the same slots of
  ``user`` and ``scratch``; with ``together`` a barrier starts every client's round at once.
  Replies per round ``(t0, t1, bytes, call seconds[], failures)`` and the same for memcpy;
* ``("finish", case)``: remove what puts stored, check a few stored objects' bytes;
* ``("release",)``: remove every object this client stored (before cases it sits out);
* ``("stop",)``.

Each round takes the next slots of the working set in turn, so consecutive rounds touch
different memory and nothing is read from a cache a previous round warmed. Puts use fresh
keys; their objects are removed (untimed) before the next round would overflow the
client's share of the store.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvfabric.bench.poolcase import Case, MiB, Op, Shape, piece_offsets, slots_for
from kvfabric.bench.stores import Driver, chunks, open_driver

POPULATE_BATCH = 32
STAMP_SALT = 0x5EED_0000_0000


class Worker:
    """One client's state (see module docstring)."""

    def __init__(self, wid: int, driver: Driver, capacity: int, barrier: Any) -> None:
        self.wid = wid
        self.driver = driver
        self.capacity = capacity
        self.barrier = barrier
        self.together = False  # whether the current case's clients start rounds together
        self.user = np.empty(capacity, np.uint8)
        self.scratch = np.empty(capacity, np.uint8)
        self.user.fill(0x5A)  # write every page now: first touch is slow
        self.scratch.fill(0xA5)
        driver.register(self.user)
        driver.register(self.scratch)
        self.tag = f"{os.getpid():x}/{wid}"
        self.seq = 0
        self.stored: tuple[Shape, int] | None = None  # (shape, slots) whose objects are stored
        self.cursor = 0
        self.pending: list[str] = []  # keys stored by put rounds, removed between rounds
        self.pending_bytes = 0

    # ------------------------------------------------------------------ helpers
    def _ptrs(self, buf: np.ndarray, shape: Shape, slots: int, idx: np.ndarray) -> np.ndarray:
        return piece_offsets(shape, slots, idx) + np.uint64(buf.ctypes.data)

    def _key(self, shape: Shape, s: int) -> str:
        return f"g/{self.tag}/{shape.name}/{s}"

    def _calls(
        self, op: Op, keys: list[str], ptrs: np.ndarray, shape: Shape, batch: int
    ) -> list[Callable[[], int]]:
        sizes = np.asarray(shape.pieces, np.uint64)
        return [
            self.driver.call(op, keys[i : i + batch], ptrs[i : i + batch], sizes)
            for i in range(0, len(keys), batch)
        ]

    def _stamp(self, shape: Shape, slots: int, idx: np.ndarray) -> None:
        offs = piece_offsets(shape, slots, idx)[:, 0]
        for s, o in zip(idx.tolist(), offs.tolist()):
            self.user[o : o + 8] = np.frombuffer(int(STAMP_SALT + s).to_bytes(8, "little"), np.uint8)

    def _store(self, shape: Shape, slots: int) -> None:
        """Make the objects of every slot readable (replacing another shape's). More slots
        than the buffer holds (``batch_exists`` keys) share their sources."""
        if self.stored == (shape, slots):
            return
        self._drop()
        fit = min(slots, slots_for(self.capacity, shape))
        if fit == 0:
            raise ValueError(f"a {shape.nbytes} B object does not fit this client's {self.capacity} B buffer")
        idx = np.arange(slots) % fit
        self._stamp(shape, fit, idx[:fit])
        keys = [self._key(shape, s) for s in range(slots)]
        ptrs = self._ptrs(self.user, shape, fit, idx)
        bad = sum(c() for c in self._calls(Op.PUT, keys, ptrs, shape, POPULATE_BATCH))
        if bad:
            why = getattr(self.driver, "last_failure", "")
            raise RuntimeError(f"storing {slots} objects of {shape.name}: {bad} puts failed ({why})")
        self.stored = (shape, slots)
        self.cursor = 0

    def _drop(self) -> None:
        if self.stored is not None:
            shape, slots = self.stored
            self.driver.remove([self._key(shape, s) for s in range(slots)])
            self.stored = None

    def _flush_puts(self) -> None:
        if self.pending:
            self.driver.remove(self.pending)
            self.pending, self.pending_bytes = [], 0

    def _slots(self, case: Case, client_bytes: int) -> int:
        if case.op is Op.EXISTS:
            return case.batch
        return slots_for(min(client_bytes, self.capacity), case.shape)

    def _next(self, n: int, slots: int) -> np.ndarray:
        idx = (self.cursor + np.arange(n)) % slots
        self.cursor = (self.cursor + n) % slots
        return idx

    def _round(
        self, case: Case, slots: int, calls: int
    ) -> tuple[list[Callable[[], int]], np.ndarray, list[str]]:
        shape, b = case.shape, case.batch
        idx = self._next(calls * b, slots)
        if case.op is Op.PUT:
            self.seq += 1
            keys = [f"p{self.seq}/{self.tag}/{s}" for s in idx.tolist()]
        else:
            keys = [self._key(shape, s) for s in idx.tolist()]
        return self._calls(case.op, keys, self._ptrs(self.user, shape, slots, idx), shape, b), idx, keys

    def _sync(self) -> None:
        if self.together:
            self.barrier.wait()

    # ------------------------------------------------------------------ commands
    def warm(self, nbytes: int) -> None:
        shape = Shape.plain(4 * MiB)
        slots = slots_for(min(nbytes, self.capacity), shape)
        if slots == 0:
            return
        for rep in range(max(1, nbytes // (slots * shape.nbytes))):
            keys = [f"w{rep}/{self.tag}/{s}" for s in range(slots)]
            ptrs = self._ptrs(self.user, shape, slots, np.arange(slots))
            for c in self._calls(Op.PUT, keys, ptrs, shape, 8):
                c()
            self.driver.remove(keys)

    def calibrate(self, case: Case, client_bytes: int) -> tuple[float, int, str]:
        """``(seconds of the second call, objects that failed, why)``."""
        slots = self._slots(case, client_bytes)
        if case.op is not Op.PUT:
            self._store(case.shape, slots)
        else:
            self._drop()
        times, bad = [], 0
        for _ in range(2):
            if case.op is Op.EXISTS:
                keys = [self._key(case.shape, s) for s in range(slots)]
                t = time.perf_counter()
                bad += len(keys) - self.driver.exists(keys)
                times.append(time.perf_counter() - t)
                continue
            calls, _, keys = self._round(case, slots, 1)
            t = time.perf_counter()
            bad += calls[0]()
            times.append(time.perf_counter() - t)
            if case.op is Op.PUT:
                self.driver.remove(keys)  # a client's share holds one batch, not two
        return times[-1], bad, getattr(self.driver, "last_failure", "") if bad else ""

    def measure(
        self, case: Case, client_bytes: int, calls: int, rounds: int, together: bool
    ) -> dict[str, Any]:
        self.together = together and self.barrier is not None
        slots = self._slots(case, client_bytes)
        if case.op is Op.EXISTS:
            return self._measure_exists(case, slots, calls, rounds)
        n, nbytes = case.shape.nbytes, calls * case.batch * case.shape.nbytes
        out: dict[str, Any] = {"rounds": [], "memcpy": []}
        for _ in range(rounds):
            fns, idx, keys = self._round(case, slots, calls)
            offs = (idx.astype(np.int64) * n).tolist()
            dst, src = (self.scratch, self.user) if case.op is Op.PUT else (self.user, self.scratch)
            pairs = [(dst[o : o + n], src[o : o + n]) for o in offs]
            groups = chunks(pairs, case.batch)
            self._sync()
            ts = [0.0] * (len(fns) + 1)
            bad = 0
            ts[0] = time.perf_counter()
            for i, fn in enumerate(fns):
                bad += fn()
                ts[i + 1] = time.perf_counter()
            self._sync()
            ms = [0.0] * (len(groups) + 1)
            ms[0] = time.perf_counter()
            for i, group in enumerate(groups):
                for d, s in group:
                    np.copyto(d, s)
                ms[i + 1] = time.perf_counter()
            self._sync()
            out["rounds"].append((ts[0], ts[-1], nbytes, np.diff(ts).tolist(), bad))
            if bad:
                out["why"] = getattr(self.driver, "last_failure", "")
            out["memcpy"].append((ms[0], ms[-1], nbytes, np.diff(ms).tolist(), 0))
            if case.op is Op.PUT:
                self.pending += keys
                self.pending_bytes += nbytes
                if self.pending_bytes + nbytes > slots * n:
                    self._flush_puts()
        return out

    def _measure_exists(self, case: Case, slots: int, calls: int, rounds: int) -> dict[str, Any]:
        keys = [self._key(case.shape, s) for s in range(slots)]
        out: dict[str, Any] = {"rounds": [], "memcpy": []}
        for _ in range(rounds):
            self._sync()
            ts = [0.0] * (calls + 1)
            bad = 0
            ts[0] = time.perf_counter()
            for i in range(calls):
                bad += len(keys) - self.driver.exists(keys)
                ts[i + 1] = time.perf_counter()
            self._sync()
            out["rounds"].append((ts[0], ts[-1], 0, np.diff(ts).tolist(), bad))
        return out

    def finish(self, case: Case) -> int:
        """Clean up after a case; the number of stored objects that read back wrong."""
        self._flush_puts()
        if case.op is not Op.GET or self.stored is None:
            return 0
        shape, slots = self.stored
        idx = np.unique(np.array([0, slots // 2, slots - 1]))
        wrong = 0
        for s in idx.tolist():
            ptrs = self._ptrs(self.scratch, shape, slots, np.array([s]))
            o = int(ptrs[0, 0]) - self.scratch.ctypes.data
            self.scratch[o : o + 8] = 0
            wrong += self._calls(Op.GET, [self._key(shape, s)], ptrs, shape, 1)[0]()
            wrong += int.from_bytes(self.scratch[o : o + 8].tobytes(), "little") != STAMP_SALT + s
        return wrong

    def set_verify(self, mode: str) -> None:
        """Whether reads check the writer's checksum (stores without checksums ignore it)."""
        setter = getattr(self.driver, "set_verify", None)
        if setter is not None:
            setter(mode)

    def release(self) -> None:
        """Remove everything this client stored (it sits the next cases out)."""
        self._flush_puts()
        self._drop()

    def close(self) -> None:
        try:
            self._flush_puts()
            self._drop()
        finally:
            self.driver.close()


def worker_main(
    conn: Connection, wid: int, store: str, params: dict[str, Any], capacity: int, barrier: Any
) -> None:
    """Entry point of a client process (see module docstring)."""
    for k, v in params.get("env", {}).items():
        os.environ[k] = v
    worker: Worker | None = None
    try:
        worker = Worker(wid, open_driver(store, params), capacity, barrier)
        conn.send(("ready", os.getpid()))
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            try:
                reply = getattr(worker, cmd)(*args)
                conn.send(("ok", reply))
            except Exception as e:  # noqa: BLE001 - reported to the host, which notes it
                if worker.together:
                    worker.barrier.abort()
                conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()[-3000:]))
    except Exception as e:  # noqa: BLE001 - a client that cannot start
        conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()[-3000:]))
    finally:
        if worker is not None:
            worker.close()
        conn.close()
