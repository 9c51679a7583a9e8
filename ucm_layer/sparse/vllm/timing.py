"""Per-request sparse selection time, for the connector's ``kvfabric.sparse`` spans.

Off by default, and then free: :data:`clock` is None and the runtime's two calls are
skipped after one module-attribute check. The connector's worker turns it on with
:func:`enable` when tracing is on; then, per step, the runtime names the rows it matched to
request states (``step``) and, per layer, the rows that read a selection and the wall time
``layer_begin`` took (``selected``: each row gets an equal share). The connector reads a
request's totals once it ended (``take``, by the engine block holding its first token,
how the runtime keys requests too), which also forgets them.

Memory: at most ``max_requests`` requests are kept (the oldest are dropped). One thread
(the worker's forward, then the connector's ``wait_for_save`` on the same thread).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Selection:
    """One request's sparse selections: its share of ``selection_s`` seconds over
    ``sparse_layer_steps`` (layer, step) selections from ``first_ns`` to ``last_ns``
    (``time.time_ns`` clock)."""

    algorithm: str
    selection_s: float
    sparse_layer_steps: int
    first_ns: int
    last_ns: int


@dataclass
class _Acc:
    algorithm: str
    first_block: int
    owner: int  # id() of the runtime's request state: a new state under a reused id starts afresh
    ns: int = 0
    steps: int = 0
    first_ns: int = 0
    last_ns: int = 0


class SelectionClock:
    """Accumulates selection time per request (see the module docstring)."""

    def __init__(self, max_requests: int = 4096) -> None:
        self.max_requests = max_requests
        self._rows: dict[int, str] = {}  # this step: vLLM row -> request state id
        self._acc: dict[str, _Acc] = {}

    def step(self, algorithm: str, picked: Iterable[tuple[int, Any]]) -> None:
        """The step's rows matched to states (``(row, state)`` with ``rid`` / ``first_block``)."""
        self._rows = {}
        for row, st in picked:
            self._rows[row] = st.rid
            acc = self._acc.get(st.rid)
            if acc is None or acc.owner != id(st) or acc.first_block != int(st.first_block):
                # a request id seen before (an engine that reuses ids, a request that ended
                # untaken) names a new request when its state is another: never merge them
                self._acc.pop(st.rid, None)
                self._acc[st.rid] = _Acc(algorithm, int(st.first_block), id(st))
                while len(self._acc) > self.max_requests:
                    del self._acc[next(iter(self._acc))]

    def selected(self, rows: Sequence[int], start_ns: int, end_ns: int) -> None:
        """``rows`` read a selection in one layer that took ``start_ns``..``end_ns``."""
        if not rows:
            return
        share = (end_ns - start_ns) // len(rows)
        for row in rows:
            acc = self._acc.get(self._rows.get(row, ""))
            if acc is None:
                continue
            acc.ns += share
            acc.steps += 1
            acc.first_ns = acc.first_ns or start_ns
            acc.last_ns = end_ns

    def take(self, first_block: int) -> Selection | None:
        """The totals of the latest request whose first token was in ``first_block`` and
        that selected at least once; forgotten afterwards."""
        for rid in reversed(list(self._acc)):
            acc = self._acc[rid]
            if acc.first_block == first_block:
                del self._acc[rid]
                if not acc.steps:
                    return None
                return Selection(acc.algorithm, acc.ns / 1e9, acc.steps, acc.first_ns, acc.last_ns)
        return None


#: the process's clock, None while nobody asked for selection times
clock: SelectionClock | None = None


def enable() -> SelectionClock:
    """Turn the clock on for this process (idempotent)."""
    global clock
    if clock is None:
        clock = SelectionClock()
    return clock


def now() -> int:
    return time.time_ns()
