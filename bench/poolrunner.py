"""``Runner``: the host side of ``kvfabric bench pool`` for one store.

Starts ``clients`` client processes (:mod:`kvfabric.bench.poolworker`, spawn) against a
running store, and measures cases with them: a calibration call sets how many calls a
round holds (about ``Plan.round_s`` seconds, at most one pass over the working set), then
``Plan.rounds`` rounds, each next to a memcpy of the same bytes in the same processes.
Figures: the median over rounds of bytes / (last client's end - first client's start),
so with several clients it is their aggregate throughput; call latency percentiles over
every call of every round; the machine load over the measured rounds (``CpuMeter``).

A case that fails (a store error, a client that died) becomes a result with a ``note``;
the runner stays usable for the next case. ``close()`` stops the clients (each removes
what it stored).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvfabric.bench.cpuload import CpuMeter, spin_forever
from kvfabric.bench.poolcase import Case, Op, Plan
from kvfabric.bench.poolworker import worker_main

REPLY_TIMEOUT_S = 900.0
LATENCY_MIN_CALLS = 200


class CaseFailed(RuntimeError):
    """A client reported an error during a case."""


@dataclass(frozen=True)
class CaseResult:
    """One store's figures for one case (seconds are reported in microseconds)."""

    gbps: float | None = None
    p50_us: float | None = None
    p99_us: float | None = None
    memcpy_gbps: float | None = None
    memcpy_p50_us: float | None = None
    calls_per_round: int = 0
    rounds: int = 0
    working_set: int = 0
    errors: int = 0
    cpu: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0  # the whole case: storing objects, calibration, rounds, checks
    note: str = ""

    @property
    def ok(self) -> bool:
        return not self.note and (self.gbps is not None or self.p50_us is not None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CaseResult:
        return cls(**d)


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)) * 1e6, 2) if xs else None


def aggregate(per_worker: list[list[tuple[float, float, int, list[float], int]]]) -> dict[str, Any]:
    """Median aggregate GB/s over rounds, call-latency percentiles, failures."""
    rates, lat, bad = [], [], 0
    for r in range(len(per_worker[0])):
        rows = [w[r] for w in per_worker]
        span = max(x[1] for x in rows) - min(x[0] for x in rows)
        nbytes = sum(x[2] for x in rows)
        if nbytes and span > 0:
            rates.append(nbytes / span / 1e9)
        for x in rows:
            lat += x[3]
            bad += x[4]
    return {
        "gbps": round(statistics.median(rates), 3) if rates else None,
        "p50_us": _pct(lat, 50),
        "p99_us": _pct(lat, 99),
        "failures": bad,
    }


def _failure_note(failed: int, wrong: int, data: list[dict[str, Any]]) -> str:
    why = sorted({d.get("why", "") for d in data} - {""})
    return f"{failed} calls' objects failed, {wrong} read back wrong" + (
        f" ({'; '.join(why)})" if why else ""
    )


class Runner:
    """Client processes of one store (see module docstring)."""

    def __init__(self, store: str, params: dict[str, Any], capacities: list[int]) -> None:
        """``capacities``: buffer bytes of each client process (``Plan.client_capacities``)."""
        self.store = store
        self.ctx = mp.get_context("spawn")
        self.barrier = self.ctx.Barrier(len(capacities))
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self.pids: list[int] = []
        try:
            for wid, cap in enumerate(capacities):
                parent, child = self.ctx.Pipe()
                proc = self.ctx.Process(
                    target=worker_main,
                    args=(child, wid, store, params, cap, self.barrier),
                    daemon=True,
                    name=f"kvfabric-bench-{store}-{wid}",
                )
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)
            for conn in self.conns:
                msg = self._recv(conn)
                self.pids.append(msg)
        except BaseException:
            self.close()
            raise

    def _recv(self, conn: Any) -> Any:
        if not conn.poll(REPLY_TIMEOUT_S):
            raise CaseFailed(f"{self.store} client did not answer within {REPLY_TIMEOUT_S:.0f} s")
        try:
            msg = conn.recv()
        except EOFError:
            raise CaseFailed(f"a {self.store} client process died") from None
        if msg[0] == "error":
            raise CaseFailed(f"{self.store} client: {msg[1]}\n{msg[2] if len(msg) > 2 else ''}")
        return msg[1]

    def _ask(self, n: int, *cmd: Any) -> list[Any]:
        for conn in self.conns[:n]:
            conn.send(cmd)
        replies, first_error = [], None
        for conn in self.conns[:n]:
            try:
                replies.append(self._recv(conn))
            except CaseFailed as e:
                first_error = first_error or e
        if first_error is not None:
            self.barrier.reset()
            raise first_error
        return replies

    def set_verify(self, mode: str) -> None:
        """Every client reads with checksum verification ``mode`` ("on" / "off")."""
        self._ask(len(self.conns), "set_verify", mode)

    def warm(self, nbytes: int) -> None:
        """Fault the store's memory in once (puts then removes ``nbytes``)."""
        self._ask(1, "warm", nbytes)

    def run(self, case: Case, plan: Plan) -> CaseResult:
        if case.clients not in (1, len(self.conns)):
            raise ValueError(f"runner has {len(self.conns)} clients; case wants {case.clients}")
        t0 = time.monotonic()
        try:
            return dataclasses.replace(self._run(case, plan), wall_s=round(time.monotonic() - t0, 2))
        except CaseFailed as e:
            try:
                self._ask(case.clients, "finish", case)
            except CaseFailed:
                pass
            return CaseResult(note=f"failed: {str(e).strip().splitlines()[0][:300]}")

    def _run(self, case: Case, plan: Plan) -> CaseResult:
        n = case.clients
        client_bytes = plan.client_bytes(case)
        slots = plan.slots(case) if case.op is not Op.EXISTS else case.batch
        if slots < case.batch:
            return CaseResult(
                note=f"skipped: {slots} objects per client fit the working set, batch {case.batch}"
            )
        for conn in self.conns[n:]:  # clients sitting this case out free their share first
            conn.send(("release",))
            self._recv(conn)
        cal = self._ask(n, "calibrate", case, client_bytes)
        est = max(c[0] for c in cal)
        if any(c[1] for c in cal):  # a store that fails the call would fail every round
            self._ask(n, "finish", case)
            why = "; ".join(sorted({c[2] for c in cal if c[2]}))
            return CaseResult(
                note=f"failed: {sum(c[1] for c in cal)} objects failed in the first calls ({why})"
            )
        if case.op is Op.EXISTS:
            lo, hi = 10, 10_000
        else:
            hi = max(1, slots // case.batch)
            lo = min(hi, LATENCY_MIN_CALLS if case.label == "latency" else 1)
        calls = int(np.clip(round(plan.round_s / max(est, 1e-7)), lo, hi))
        spinner = None
        if case.condition == "other-core-busy":
            spinner = self.ctx.Process(target=spin_forever, daemon=True, name="kvfabric-bench-spin")
            spinner.start()
        try:
            meter = CpuMeter(os.getpid(), frozenset([spinner.pid]) if spinner else frozenset()).start()
            data = self._ask(n, "measure", case, client_bytes, calls, plan.rounds, n > 1)
            cpu = meter.stop()
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.join()
        wrong = sum(self._ask(n, "finish", case))
        ours = aggregate([d["rounds"] for d in data])
        base = aggregate([d["memcpy"] for d in data]) if data[0]["memcpy"] else {}
        return CaseResult(
            gbps=ours["gbps"],
            p50_us=ours["p50_us"],
            p99_us=ours["p99_us"],
            memcpy_gbps=base.get("gbps"),
            memcpy_p50_us=base.get("p50_us"),
            calls_per_round=calls,
            rounds=plan.rounds,
            working_set=slots * case.shape.nbytes * n if case.op is not Op.EXISTS else 0,
            errors=ours["failures"] + wrong,
            cpu=cpu,
            note="" if ours["failures"] + wrong == 0 else _failure_note(ours["failures"], wrong, data),
        )

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
        for proc in self.procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
