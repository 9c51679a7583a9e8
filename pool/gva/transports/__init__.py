"""Transports of ``xcopy``: one registry, imported lazily by name.

* ``mapped`` (``mapped.py``): both ends addressable in this process; platform copies.
* ``remote`` (``remote.py``): a transfer engine (Mooncake) moves bytes to or from a
  rank that published a route.

The contract is in ``base.py``.
"""

from __future__ import annotations

import importlib

from kvfabric.pool.gva.transports.base import Transport, TransportContext

TRANSPORTS: dict[str, str] = {
    "mapped": "kvfabric.pool.gva.transports.mapped:MappedTransport",
    "remote": "kvfabric.pool.gva.transports.remote:RemoteTransport",
}


def build(name: str, ctx: TransportContext) -> Transport:
    """Instantiate transport ``name`` for the fabric described by ``ctx``."""
    target = TRANSPORTS.get(name)
    if target is None:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(sorted(TRANSPORTS))}")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)(ctx)


__all__ = ["TRANSPORTS", "Transport", "TransportContext", "build"]
