"""``Copier``: the copies and address resolution of one rank, over the rank's current view.

A :class:`~kvfabric.pool.gva.fabric.Fabric` keeps the membership (join, leave, the
monitor, mapping windows as the segment table changes); its ``Copier`` turns addresses
into bytes moved: ``resolve`` / ``local_address`` (the fast path over the view's flat
per-region tables), ``xcopy`` / ``batch_xcopy`` and their ``_sync`` forms (planned by
``xcopy.plan``, run by ``handle.submit``). The fabric's methods of the same names
delegate here; ``fabric.py`` documents each call for users.

Contract:

* ``view``: the :class:`~kvfabric.pool.gva.view.View` copies run against. The fabric sets
  it (under its lock) each time it installs a segment table; a call reads it once, so a
  copy runs entirely against one view.
* ``transports``: the enabled transports by name; the fabric's own dict, which it fills
  when it joins and empties at teardown (the fabric owns and closes them).
* ``may_copy()``: called before every copy; raises ``RankUnavailable`` once the rank left
  or was evicted (the fabric's state). Resolution does not call it: an address in a window
  still mapped here resolves until the fabric unmaps it.

Thread-safe: nothing here mutates; views are immutable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvfabric.errors import RankUnavailable
from kvfabric.platform.base import Platform
from kvfabric.platform.types import CopyBatch, Span
from kvfabric.pool.gva.address import region_of, unpack
from kvfabric.pool.gva.config import GvaConfig
from kvfabric.pool.gva.handle import XferHandle, submit
from kvfabric.pool.gva.single import copy_one
from kvfabric.pool.gva.transports import Transport
from kvfabric.pool.gva.view import View
from kvfabric.pool.gva.xcopy import as_batch, plan

Items = CopyBatch | Iterable[tuple[Any, Any, int]]


class Copier:
    """Copies and address resolution of one rank (see module docstring)."""

    def __init__(
        self,
        config: GvaConfig,
        platform: Platform,
        transports: dict[str, Transport],
        view: View,
        may_copy: Callable[[], None],
    ) -> None:
        self.config = config
        self.platform = platform
        self.transports = transports
        self.view = view
        self.may_copy = may_copy

    # ------------------------------------------------------------------ fast path
    def local_address(self, gva: int, nbytes: int) -> int:
        ptr, off, _buf = self._mapped(gva, nbytes)
        return ptr + off

    def resolve(self, gva: int, nbytes: int) -> Span:
        _ptr, off, buf = self._mapped(gva, nbytes)
        return Span(buf, off, nbytes)

    def _mapped(self, gva: int, nbytes: int) -> tuple[int, int, Any]:
        """``(window address, offset, window buffer)`` of a range mapped here, from the
        view's flat per-region tables; anything else goes to ``_unresolvable``."""
        view = self.view
        region = region_of(gva)
        try:
            stride, slots = view.fast[region if region > 0 else 3]
            _region, rank, off = unpack(gva, stride)
            ptr, size, buf = slots[rank]  # type: ignore[misc]
        except (IndexError, TypeError):
            return _unresolvable(view, self.config.node, gva, nbytes)
        if nbytes <= 0 or off + nbytes > size:
            return _unresolvable(view, self.config.node, gva, nbytes)
        return ptr, off, buf

    # ------------------------------------------------------------------ copies
    def xcopy(self, dst: Any, src: Any, nbytes: int | None, version: int | None) -> XferHandle:
        """One copy, asynchronous (``copy_one`` returns a handle off the synchronous path)."""
        self.may_copy()
        return copy_one(
            self.view, self.config, self.platform, self.transports, dst, src, nbytes, version, False
        )

    def xcopy_sync(self, dst: Any, src: Any, nbytes: int | None, version: int | None) -> None:
        """One copy, done when this returns; ``TransferFailed`` if it failed."""
        self.may_copy()
        h = copy_one(self.view, self.config, self.platform, self.transports, dst, src, nbytes, version, True)
        if h is not None:  # None: copied directly already
            h.raise_for_status()

    def batch_xcopy(self, items: Items, version: int | None, inline: bool) -> XferHandle:
        """Many pieces, grouped by rank pair; ``inline``: run in this thread, finished."""
        self.may_copy()
        view = self.view
        return submit(
            view, plan(view, self.config, self.platform, self.transports, as_batch(items), version), inline
        )


def _unresolvable(view: View, node: str, gva: int, nbytes: int) -> Any:
    """Raise why ``[gva, gva + nbytes)`` does not resolve here."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes must be an int > 0, got {nbytes!r}")
    seg, _off = view.table.locate(gva, nbytes)  # raises for bad or absent ranges
    raise RankUnavailable(
        f"rank {seg.rank}'s {seg.medium.value} window is not mapped in this process "
        f"(node {seg.node}, this is {node}): use xcopy"
    )
