"""Transports of ``xcopy``: one registry, imported lazily by name.

* ``mapped`` (``mapped.py``): both ends addressable in this process; platform copies.
* ``remote`` (``remote.py``): a transfer engine (Mooncake) moves bytes to or from a
  rank that published a route.

The contract is in ``base.py``.
"""

from __future__ import annotations

from kvfabric.pool.gva.transports.base import Transport, TransportContext
from kvfabric.registry import Registry

TRANSPORTS: Registry[type[Transport]] = Registry(
    "transport",
    {
        "mapped": "kvfabric.pool.gva.transports.mapped:MappedTransport",
        "remote": "kvfabric.pool.gva.transports.remote:RemoteTransport",
    },
)


def build(name: str, ctx: TransportContext) -> Transport:
    """Instantiate transport ``name`` for the fabric described by ``ctx``."""
    return TRANSPORTS.create(name, ctx)


__all__ = ["TRANSPORTS", "Transport", "TransportContext", "build"]
