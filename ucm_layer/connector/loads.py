"""Asynchronous-load tracking of a worker: the loads in flight, their deadlines, the stall
hold, and which requests vLLM may hear about.

A load issued for ``plan.async_loads`` runs while the engine keeps stepping; vLLM learns
that a request's load ended when ``get_finished`` reports it. :class:`AsyncLoads` keeps
those loads between steps and decides when each has ended; the worker role owns the
loads' data movement, their counters and their failed blocks (``worker.py``,
``repair.py``).

Contract (call order per engine step, what mutates):

* ``begin(plan)`` once per plan, in ``start_load``: remembers whether the step is
  ``idle`` (no request computes).
* For each transfer of ``plan.async_loads``, the worker first asks ``hold(t)``: the
  transfer up to its first block whose load timed out on this worker within
  ``STALL_HOLD_S``, and the rest, which the worker fails at once (``TIMEOUT``). Then either
  ``track(t, op)`` (the Delegator's ``LoadOp`` is running) or ``ended(req_id)`` (nothing to
  load, or the load failed when it was issued: reported by the next ``collect``).
* ``collect()`` after every step (vLLM's ``get_finished``, forward or not): the requests to
  report now, and every load that ended since the last call (:class:`LoadEnd`, its
  statuses waited on: the good blocks are scattered). A load still running
  ``timeout_s`` (``load_timeout_s``) after it was issued is cancelled (the store's cancel
  guarantees nothing writes its blocks afterwards; its unfinished blocks read
  ``TIMEOUT``) and its first timed-out block is held for ``STALL_HOLD_S``, so a store copy
  that stalls costs one timeout, not one per request sharing the prefix. On an ``idle``
  step with loads in flight and nothing to report, ``collect`` first sleeps in short
  slices, at most ``IDLE_WAIT_S``, until one ends (the engine would only call again at
  once, and that busy loop takes the interpreter from the threads doing the load). The
  worker handles each :class:`LoadEnd` before it returns the requests to vLLM, so failed
  blocks reach vLLM no later than the step that reports their request.
* Several KV cache groups (``multi_group``): a request has one load per group and is
  reported once the last of them ended; ``failed(req_id)`` marks a request whose load
  failed in some group, and ``failed_requests()`` hands each such request over once it
  was reported (vLLM's ``failed_recving``).
* ``cancel_all()`` at close: every load in flight stops writing the KV cache.

Memory: the loads write engine blocks the worker's Delegator owns the addresses of; this
module touches no memory, only ops. Not thread-safe: one worker thread calls it (vLLM's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from kvfabric.status import wait_or_cancel
from kvfabric.ucm_layer.connector.plan import Transfer
from kvfabric.ucm_layer.delegator import LoadOp
from kvfabric.ucm_layer.store.base import BlockStatus

#: longest an idle step waits for an async load to end (see ``StepPlan.idle``)
IDLE_WAIT_S = 0.02
#: how long a block whose async load timed out is not loaded again by this worker
STALL_HOLD_S = 300.0

TagFn = Callable[[np.ndarray, int], np.ndarray]  # (base ids, group) -> the worker's ids


@dataclass
class _InFlight:
    """An asynchronous load in flight: its op, its request's blocks, when it must end."""

    op: LoadOp
    transfer: Transfer
    deadline: float  # time.monotonic()
    started: float  # time.perf_counter()
    start_ns: int


@dataclass(frozen=True)
class LoadEnd:
    """An asynchronous load that ended: its ``transfer``, the per-block store ``status``
    (None: waiting on it raised, ``error`` says how), the seconds since it was issued and
    its start (``time.time_ns``, for spans)."""

    transfer: Transfer
    status: np.ndarray | None
    error: str
    secs: float
    start_ns: int


class AsyncLoads:
    """The asynchronous loads of one worker (see module docstring)."""

    def __init__(self, timeout_s: float, tag: TagFn, *, multi_group: bool = False) -> None:
        self.timeout_s = timeout_s
        self.multi_group = multi_group
        self._tag = tag
        self._inflight: dict[tuple[str, int], _InFlight] = {}  # by (request, group)
        self._ended: set[str] = set()  # loads that ended at issue (reported next)
        self._idle = False  # the current plan has no request computing (StepPlan.idle)
        self._stalled: dict[bytes, float] = {}  # tagged id -> until when its loads fail at once
        self._failed: set[str] = set()  # several groups: requests whose load failed

    def begin(self, idle: bool) -> None:
        self._idle = idle

    # ------------------------------------------------------------------ issue
    def hold(self, t: Transfer) -> tuple[Transfer, Transfer]:
        """``t`` split at its first block whose load timed out here within ``STALL_HOLD_S``:
        the part to load, and the held rest, which fails at once (``TIMEOUT``, vLLM computes
        it; the store keeps the copy: a timeout says nothing against its bytes, and a dump
        of the recomputed block does not replace it)."""
        if not self._stalled:
            return t, replace(t, ids=t.ids[:0], blocks=t.blocks[:0])
        now = time.monotonic()
        self._stalled = {k: until for k, until in self._stalled.items() if until > now}
        tagged = self._tag(t.ids, t.group)
        first = next((i for i, row in enumerate(tagged) if row.tobytes() in self._stalled), t.blocks.size)
        return (
            replace(t, ids=t.ids[:first], blocks=t.blocks[:first]),
            replace(t, ids=t.ids[first:], blocks=t.blocks[first:]),
        )

    def track(self, t: Transfer, op: LoadOp) -> None:
        """``op`` loads ``t``; it must end within ``timeout_s``."""
        self._inflight[(t.req_id, t.group)] = _InFlight(
            op, t, time.monotonic() + self.timeout_s, time.perf_counter(), time.time_ns()
        )

    def ended(self, req_id: str) -> None:
        """``req_id``'s load ended when it was issued (the next ``collect`` reports it)."""
        self._ended.add(req_id)

    def failed(self, req_id: str) -> None:
        """Several groups: ``req_id``'s load failed in some group."""
        if self.multi_group:
            self._failed.add(req_id)

    # ------------------------------------------------------------------ per step
    def collect(self) -> tuple[set[str], list[LoadEnd]]:
        """The requests whose load ended (in every group) since the last call, and the loads
        that ended (see module docstring)."""
        done, self._ended = self._ended, set()
        if self._idle and self._inflight and not done:
            self._await_any(IDLE_WAIT_S)
        now = time.monotonic()
        ends: list[LoadEnd] = []
        for key, a in list(self._inflight.items()):
            finished = a.op.check()
            if not finished and now < a.deadline:
                continue
            del self._inflight[key]
            done.add(key[0])
            status, error = None, ""
            try:  # done: scatter the good blocks; past the deadline: cancel what is left
                status = wait_or_cancel(a.op, None if finished else 0.0)
            except Exception as e:  # noqa: BLE001 - a failed load is a recompute
                error = f"{type(e).__name__}: {e}"
            else:
                if not finished:
                    self._note_stall(a.transfer, status)
            ends.append(LoadEnd(a.transfer, status, error, time.perf_counter() - a.started, a.start_ns))
        if self.multi_group:  # a request ends once every group's load did
            running = self.running()
            self._ended = done & running
            done -= running
        return done, ends

    def _note_stall(self, t: Transfer, status: np.ndarray) -> None:
        timed_out = np.flatnonzero(status == BlockStatus.TIMEOUT)
        if timed_out.size:
            until = time.monotonic() + STALL_HOLD_S
            for row in self._tag(t.ids[timed_out[:1]], t.group):  # the first: vLLM computes from it
                self._stalled[row.tobytes()] = until

    def _await_any(self, seconds: float) -> None:
        """Sleep in short slices until a load is done or past its deadline, for at most
        ``seconds`` (an idle step: no forward waits on this worker meanwhile)."""
        end = time.monotonic() + seconds
        while True:
            now = time.monotonic()
            if now >= end or any(a.op.check() or now >= a.deadline for a in self._inflight.values()):
                return
            time.sleep(0.0002)

    def running(self) -> set[str]:
        """Requests with a load in flight."""
        return {r for r, _ in self._inflight}

    def failed_requests(self) -> set[str]:
        """Several groups: requests whose load failed in some group and that ``collect``
        reported; each once."""
        if not self._failed:
            return set()
        out = self._failed - (self.running() | self._ended)
        self._failed -= out
        return out

    def __len__(self) -> int:
        """Loads in flight."""
        return len(self._inflight)

    def cancel_all(self) -> None:
        """Stop every load in flight: when this returns nothing writes the KV cache."""
        for a in self._inflight.values():
            try:
                wait_or_cancel(a.op, 0.0)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        self._inflight.clear()
