"""``XferHandle``: an xcopy in flight, and ``submit``, which runs a validated plan.

An ``XferHandle`` is a :class:`kvfabric.status.Handle`: ``check()`` polls, ``wait(timeout)``
blocks and returns ``status``, the per-item :class:`~kvfabric.status.ItemStatus` array
(``PENDING`` until an item's group finished, then ``OK`` or ``FAILED``); a ``TimeoutError``
leaves the handle waitable again, and waiting a finished handle returns the same array.
A group that fails marks only its own items ``FAILED`` (``errors`` says why), the others
complete. No ``cancel``: copies cannot be recalled. Mapped windows a group uses stay
pinned until it completes, so they are not unmapped under a copy when their owner
leaves. Any thread may ``check``; one consumer waits on a handle.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from kvfabric.errors import KVFabricError, TransferFailed
from kvfabric.pool.gva.address import LOCAL_KEY
from kvfabric.pool.gva.transports.base import Completion
from kvfabric.pool.gva.view import MappedWindow, View
from kvfabric.pool.gva.xcopy import Planned
from kvfabric.status import ItemStatus, pending


class XferHandle:
    """An xcopy in flight (see module docstring). Thread-safe; one consumer waits."""

    def __init__(self, n: int) -> None:
        self.status = pending(n)
        self.errors: list[tuple[np.ndarray, BaseException]] = []
        self._parts: list[tuple[np.ndarray, Completion, list[MappedWindow]]] = []
        self._lock = threading.Lock()

    def _add(self, index: np.ndarray, comp: Completion, pins: list[MappedWindow]) -> None:
        self._parts.append((index, comp, pins))

    def _fail(self, index: np.ndarray, err: BaseException) -> None:
        self.status[index] = ItemStatus.FAILED
        self.errors.append((index, err))

    def _finish(self, k: int, timeout: float | None) -> None:
        index, comp, pins = self._parts[k]
        try:
            comp.wait(timeout)
        except TimeoutError:
            raise
        except KVFabricError as e:
            self._fail(index, e)
        else:
            self.status[index] = ItemStatus.OK
        for m in pins:
            m.unpin()
        self._parts[k] = (index, comp, [])

    def check(self) -> bool:
        """True when every item has finished (successfully or not); never blocks."""
        with self._lock:
            for k, (index, comp, _pins) in enumerate(self._parts):
                if self.status[index[0]] == ItemStatus.PENDING and comp.check():
                    self._finish(k, 0)
            return not (self.status == ItemStatus.PENDING).any()

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """Block until every item finished; the status array. ``TimeoutError`` on expiry (the
        handle stays waitable)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            for k, (index, _comp, _pins) in enumerate(self._parts):
                if self.status[index[0]] == ItemStatus.PENDING:
                    left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                    self._finish(k, left)
        return self.status

    @property
    def ok(self) -> bool:
        return bool((self.status == ItemStatus.OK).all())

    def raise_for_status(self) -> None:
        """``TransferFailed`` naming the failed items, chained to the first failure."""
        if self.errors:
            failed = int((self.status == ItemStatus.FAILED).sum())
            index, err = self.errors[0]
            raise TransferFailed(
                f"{failed} of {self.status.size} xcopy item(s) failed (first: item {int(index[0])}: {err})"
            ) from err


def submit(view: View, planned: Planned, sync: bool) -> XferHandle:
    """Run every group of ``planned``; failures land in the handle, never half-raised."""
    h = XferHandle(planned.n)
    for g, t in zip(planned.groups, planned.transports):
        pins: list[MappedWindow] = []
        try:
            for key in (g.src_key, g.dst_key):
                e = view.ends.get(key) if key != LOCAL_KEY else None
                if e is not None and e.mapped is not None and t.name == "mapped":
                    e.mapped.pin()
                    pins.append(e.mapped)
            comp = t.submit(view, g, sync)
        except (KVFabricError, OSError) as err:
            for m in pins:
                m.unpin()
            h._fail(g.index, err)
            continue
        if sync:
            for m in pins:
                m.unpin()
            h.status[g.index] = ItemStatus.OK
        else:
            h._add(g.index, comp, pins)
    return h
