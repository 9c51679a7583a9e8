"""Per-key outcomes of pool operations (the values travel in RPC status arrays).

``Status`` is :class:`kvfabric.status.ItemStatus`, the one per-item vocabulary of
kvfabric; the pool's names are kept (``NOT_FOUND`` is ``MISSING``, ``TRANSFER_FAILED``
is ``FAILED``). What a pool operation reports: ``OK``; ``EXISTS`` (put of a key that is
already stored, or being stored: left untouched); ``NOT_FOUND`` (no readable object
under the key); ``NO_SPACE`` (nothing fits even after eviction, or the directory is
full); ``LEASE_EXPIRED`` (a write or read lease ran out before the operation finished);
``INVALID`` (bad key or size: the message names which); ``TRANSFER_FAILED`` (the bytes
could not be moved); ``UNAVAILABLE`` (the meta service did not answer); ``CORRUPT`` (the
bytes read do not match the writer's checksum: treated as a miss).
"""

from __future__ import annotations

from kvfabric.status import ItemStatus

Status = ItemStatus

__all__ = ["Status"]
