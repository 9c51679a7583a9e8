"""kvfabric.pool.gva: the global virtual address space and ``xcopy`` between any two windows.

``gva = base[medium] + rank * stride[medium] + offset``: one integer names the same byte
in every process of the pool (``address.py``). The membership of the pool lives in a
rendezvous store (``rendezvous/``: the single-node server the pool daemon hosts, or
etcd); every process derives the same :class:`SegmentTable` from it (``segments.py``).

The API the object pool builds on (all in :class:`~kvfabric.pool.gva.fabric.Fabric`):

1. Join with zero or more windows: ``Fabric.join(url_or_store, platform, {Medium.DRAM:
   size or Buffer}, config=GvaConfig(...))``; a metadata-only client passes none and
   still maps and copies the others' windows. ``fab.window(medium)`` is this rank's
   window as a platform ``Buffer``; ``fab.gva(medium, offset, rank)`` names a byte.
2. Fast path, no RPC and no copy: ``fab.resolve(gva, n) -> Span`` and
   ``fab.local_address(gva, n) -> int`` for any window mapped in this process (this
   rank's own and same-node ranks'); well under a microsecond of Python per call.
3. Copies: ``fab.xcopy(dst, src, n)`` / ``fab.batch_xcopy(CopyBatch or [(dst, src, n)])``
   return an :class:`~kvfabric.pool.gva.handle.XferHandle` (``check``, ``wait``, per-item
   ``status``); ``xcopy_sync`` / ``batch_xcopy_sync`` block and raise ``TransferFailed``.
   Each end is a GVA, a local ``Buffer``/``Span``, or a local address (any int below
   ``GVA_FLOOR``), so many local pieces go into one GVA region (and back) in one call.
4. Membership changes: ``fab.subscribe(fn)`` calls ``fn(MembershipChange)`` after every
   join, leave or death (``change.left`` lists departed ranks); ``fab.wait_for(pred)``.

Transports (``transports/``): ``mapped`` (platform copies between windows mapped here)
and ``remote`` (Mooncake Transfer Engine), chosen per rank pair (``GvaConfig``).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Gva": "kvfabric.pool.gva.address",
    "AddressSpace": "kvfabric.pool.gva.address",
    "GVA_FLOOR": "kvfabric.pool.gva.address",
    "SegmentTable": "kvfabric.pool.gva.segments",
    "Segment": "kvfabric.pool.gva.segments",
    "GvaConfig": "kvfabric.pool.gva.config",
    "PairRule": "kvfabric.pool.gva.config",
    "Fabric": "kvfabric.pool.gva.fabric",
    "FabricState": "kvfabric.pool.gva.fabric",
    "MembershipChange": "kvfabric.pool.gva.fabric",
    "XferHandle": "kvfabric.pool.gva.handle",
    "ItemStatus": "kvfabric.pool.gva.handle",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvfabric.pool.gva' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)
