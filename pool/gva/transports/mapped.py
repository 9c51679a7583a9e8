"""``mapped``: both ends are addressable in this process, so the platform copies them.

Serves a group when each side is plain local memory, this rank's own window, or the
window of a same-node rank mapped here through ``Platform.import_handle``. A group
becomes one ``Platform.batch_copy`` (plain memory copies on the sim platform, the
device copy engine on CUDA/Ascend); the synchronous path runs it on the calling thread,
the asynchronous one queues it on one of ``GvaConfig.copy_streams`` platform streams and
completes through an event recorded behind it.
"""

from __future__ import annotations

import itertools

import numpy as np

from kvfabric.errors import TransferFailed
from kvfabric.platform.stream import Event
from kvfabric.platform.types import CopyBatch, Span
from kvfabric.pool.gva.transports.base import (
    DONE,
    Completion,
    GroupPlan,
    Transport,
    TransportContext,
    ok_one,
)
from kvfabric.pool.gva.view import View


class EventCompletion(Completion):
    """A group queued on a platform stream; done when the event behind it is."""

    __slots__ = ("_done", "event", "what")

    def __init__(self, event: Event, what: str) -> None:
        self.event = event
        self.what = what
        self._done = False

    def check(self) -> bool:
        if not self._done:
            self._done = self.event.query()
        return self._done

    def wait(self, timeout: float | None = None) -> np.ndarray:
        try:
            self.event.synchronize(timeout)
        except TransferFailed as e:
            raise TransferFailed(f"{self.what} failed: {e}") from e
        self._done = True
        return ok_one()


class MappedTransport(Transport):
    """Copies between memory this process can address (see module docstring)."""

    name = "mapped"

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._streams = [ctx.platform.stream() for _ in range(ctx.config.copy_streams)]
        self._next = itertools.cycle(range(len(self._streams)))

    def can_serve(self, view: View, src_key: int, dst_key: int) -> bool:
        return view.addressable(src_key) and view.addressable(dst_key)

    def submit(self, view: View, group: GroupPlan, sync: bool) -> Completion:
        plat = self.ctx.platform
        batch = CopyBatch(
            view.local_ptrs(group.dst_key, group.dst, group.dst_off),
            view.local_ptrs(group.src_key, group.src, group.src_off),
            group.nbytes,
        )
        what = (
            f"mapped copy of {len(group)} piece(s), {group.total_bytes} B, rank "
            f"{view.rank_of(group.src_key)} -> rank {view.rank_of(group.dst_key)}"
        )
        if sync:
            try:
                plat.batch_copy(batch)
            except TransferFailed as e:
                raise TransferFailed(f"{what} failed: {e}") from e
            return DONE
        stream = self._streams[next(self._next)]
        plat.batch_copy(batch, stream=stream)
        ev = plat.event()
        ev.record(stream)
        return EventCompletion(ev, what)

    def copy_spans(self, dst: Span, src: Span, sync: bool) -> Completion:
        """One piece between two spans of this platform (the single-item fast path)."""
        plat = self.ctx.platform
        if sync:
            plat.copy(dst, src, dst.nbytes)
            return DONE
        stream = self._streams[next(self._next)]
        plat.copy(dst, src, dst.nbytes, stream=stream)
        ev = plat.event()
        ev.record(stream)
        return EventCompletion(ev, f"mapped copy of {dst.nbytes} B")

    def close(self) -> None:
        for s in self._streams:
            s.close()
        self._streams = []
