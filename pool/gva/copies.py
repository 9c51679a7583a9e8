"""``FabricCopies``: the fast path and the copy calls of a :class:`~kvfabric.pool.gva.fabric.Fabric`.

A mixin: it reads the fabric's installed ``View`` (``self._view``), configuration,
platform and transports, and checks membership (``self._check_member``) before a copy.
See ``fabric.py`` for the contract of each call.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvfabric.errors import RankUnavailable
from kvfabric.platform.types import CopyBatch, Span
from kvfabric.pool.gva.address import region_of, unpack
from kvfabric.pool.gva.handle import XferHandle, submit
from kvfabric.pool.gva.single import copy_one
from kvfabric.pool.gva.xcopy import as_batch, plan

if TYPE_CHECKING:
    from kvfabric.platform.base import Platform
    from kvfabric.pool.gva.config import GvaConfig
    from kvfabric.pool.gva.transports import Transport
    from kvfabric.pool.gva.view import View


class FabricCopies:
    """Copies and address resolution of one rank (see module docstring)."""

    _view: View
    config: GvaConfig
    platform: Platform
    _transports: dict[str, Transport]

    def _check_member(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ fast path
    def local_address(self, gva: int, nbytes: int) -> int:
        """The address in this process of ``[gva, gva + nbytes)`` (mapped ranks only)."""
        ptr, off, _buf = self._mapped(gva, nbytes)
        return ptr + off

    def resolve(self, gva: int, nbytes: int) -> Span:
        """A platform ``Span`` of ``[gva, gva + nbytes)`` in this process (mapped ranks only)."""
        _ptr, off, buf = self._mapped(gva, nbytes)
        return Span(buf, off, nbytes)

    def _mapped(self, gva: int, nbytes: int) -> tuple[int, int, Any]:
        """``(window address, offset, window buffer)`` of a range mapped here, from the
        view's flat per-region tables; anything else goes to ``_unresolvable``."""
        region = region_of(gva)
        try:
            stride, slots = self._view.fast[region if region > 0 else 3]
            _region, rank, off = unpack(gva, stride)
            ptr, size, buf = slots[rank]  # type: ignore[misc]
        except (IndexError, TypeError):
            return self._unresolvable(gva, nbytes)
        if nbytes <= 0 or off + nbytes > size:
            return self._unresolvable(gva, nbytes)
        return ptr, off, buf

    def _unresolvable(self, gva: int, nbytes: int) -> Any:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be an int > 0, got {nbytes!r}")
        seg, _off = self._view.table.locate(gva, nbytes)  # raises for bad or absent ranges
        raise RankUnavailable(
            f"rank {seg.rank}'s {seg.medium.value} window is not mapped in this process "
            f"(node {seg.node}, this is {self.node}): use xcopy"
        )

    # ------------------------------------------------------------------ copies
    def xcopy(
        self, dst: Any, src: Any, nbytes: int | None = None, *, version: int | None = None
    ) -> XferHandle:
        """Copy ``nbytes`` from ``src`` to ``dst`` (GVAs or local memory); asynchronous."""
        self._check_member()
        return copy_one(
            self._view, self.config, self.platform, self._transports, dst, src, nbytes, version, False
        )

    def xcopy_sync(
        self, dst: Any, src: Any, nbytes: int | None = None, *, version: int | None = None
    ) -> None:
        """``xcopy`` that returns once the bytes are in place; ``TransferFailed`` if not."""
        self._check_member()
        h = copy_one(
            self._view, self.config, self.platform, self._transports, dst, src, nbytes, version, True
        )
        if h is not None:
            h.raise_for_status()

    def batch_xcopy(
        self,
        items: CopyBatch | Iterable[tuple[Any, Any, int]],
        *,
        version: int | None = None,
        inline: bool = False,
    ) -> XferHandle:
        """Copy many ``(dst, src, nbytes)`` pieces; grouped by rank pair; asynchronous.

        ``inline``: run the copies in the calling thread and return a finished handle
        (per-item statuses, nothing raised): the cheapest way when the caller would wait
        at once anyway."""
        self._check_member()
        view = self._view
        return submit(
            view, plan(view, self.config, self.platform, self._transports, as_batch(items), version), inline
        )

    def batch_xcopy_sync(
        self, items: CopyBatch | Iterable[tuple[Any, Any, int]], *, version: int | None = None
    ) -> None:
        """``batch_xcopy`` that returns when every piece is in place; raises if any failed."""
        self._check_member()
        view = self._view
        h = submit(
            view, plan(view, self.config, self.platform, self._transports, as_batch(items), version), True
        )
        h.raise_for_status()
