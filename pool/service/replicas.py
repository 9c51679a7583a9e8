"""Replicas in the directory: an object's N extents, and where they are placed.

An object stored with ``replicas: N`` has N extents of the same bytes (same size, same
generation, same writer's checksum) in the windows of N distinct ranks. The directory
keeps them in the shared table (``table.py``) with no change to its layout:

* the **primary slot** is the object's own key; its ``gva`` is one extent (state
  ``ALLOCATED`` while written, ``READABLE`` once committed). Every reader, event, listing,
  TTL and eviction decision goes by it, so an object with N extents is one block;
* each further extent ``i`` (1 .. N-1) is a **replica slot** under the reserved key
  :func:`replica_key` (``\\xff\\xfer`` + ``i`` + the key; no client key starts with
  ``\\xff\\xfe``), state ``ALLOCATED`` while written, ``REPLICA`` once committed; no
  listing, event or eviction counts it. Indices stay dense: removing extent ``i``
  moves the last one into its place (:meth:`ReplicaSlots.drop`).

Readers on the node probe ``replica_key(key, 1)``, ``2``, ... after the primary (a probe is
a C lookup); readers elsewhere get every extent in the ``lookup`` reply.

Placement (:func:`place`): windows on distinct *nodes* first (the fabric's node id of each
rank), then windows of ranks not used yet on nodes already used (a copy that survives its
process, not its node), never two extents in one rank. With fewer ranks that fit than N,
as many as there are are placed and the allocation says how many (``placed``): the put is
stored with fewer replicas, never refused for it.

Pure helpers over a ``TableWriter``; the meta service calls them from its one thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfabric.pool.protocol import MAX_REPLICAS, REPLICA_PREFIX, check_replicas, replica_key
from kvfabric.pool.table import Hit

if TYPE_CHECKING:
    from kvfabric.pool.service.records import Window
    from kvfabric.pool.service.table_writer import TableWriter


def is_replica_key(raw: bytes) -> bool:
    return raw.startswith(REPLICA_PREFIX) and len(raw) > len(REPLICA_PREFIX) + 1


def client_key(raw: bytes) -> bytes:
    """The object's key of a directory key (a replica slot's, or the key itself)."""
    return raw[len(REPLICA_PREFIX) + 1 :] if is_replica_key(raw) else raw


@dataclass(frozen=True)
class ReplicaSlots:
    """The replica slots of objects in one table (see module docstring)."""

    table: TableWriter

    def hits(self, key: bytes) -> list[Hit]:
        """The replica slots of ``key``, index 1 first (none for an object of one extent)."""
        out = []
        for i in range(1, MAX_REPLICAS):
            hit = self.table.find(replica_key(key, i))
            if hit is None:
                break
            out.append(hit)
        return out

    def gvas(self, key: bytes) -> list[int]:
        return [h.gva for h in self.hits(key)]

    def add(self, key: bytes, gva: int, size: int, gen: int, state: int, csum: int = 0) -> int:
        """A new replica slot after the last one; its index. ``OutOfSpace`` when the table is full."""
        i = len(self.hits(key)) + 1
        if i >= MAX_REPLICAS:
            raise ValueError(f"an object has at most {MAX_REPLICAS} extents")
        slot, _ = self.table.insert(replica_key(key, i), gva, size, gen, state)  # type: ignore[arg-type]
        if csum:
            self.table.update(slot, csum=csum)
        return i

    def drop(self, key: bytes, gva: int) -> bool:
        """Take the replica slot of ``key`` at ``gva`` out, keeping the indices dense."""
        hits = self.hits(key)
        at = next((i for i, h in enumerate(hits) if h.gva == gva), None)
        if at is None:
            return False
        last = hits[-1]
        if at != len(hits) - 1:  # move the last extent into the hole, then drop the last slot
            self.table.update(hits[at].slot, gva=last.gva, state=int(last.state))
            last = self.table.find(replica_key(key, len(hits)))  # type: ignore[assignment]
        if last is not None:
            self.table.remove(last.slot)
        return True

    def drop_all(self, key: bytes) -> list[Hit]:
        """Take every replica slot of ``key`` out; the slots as they were."""
        hits = self.hits(key)
        for i in range(len(hits), 0, -1):  # each removal may move other slots: look each up
            hit = self.table.find(replica_key(key, i))
            if hit is not None:
                self.table.remove(hit.slot)
        return hits


def place(
    windows: Sequence[Window],
    replicas: int,
    node_of: Callable[[int], str],
    fits: Callable[[Window], int | None],
    placed: list[tuple[Window, int]] | None = None,
    nodes_only: bool = False,
) -> list[tuple[Window, int]]:
    """Extents for one object: ``windows`` in placement order (the first that fits takes
    the first extent), ``fits(w)``: an offset in ``w`` or None (it may evict). At most
    ``replicas`` extents, on distinct nodes first, then (unless ``nodes_only``) on distinct
    ranks; ``placed``: the extents found by an earlier pass (kept, and extended)."""
    placed = list(placed or [])
    ranks = {w.rank for w, _ in placed}
    nodes = {node_of(w.rank) for w, _ in placed}
    for distinct_nodes in (True,) if nodes_only or replicas == 1 else (True, False):
        for w in windows:
            if len(placed) >= replicas:
                return placed
            if w.rank in ranks or (distinct_nodes and node_of(w.rank) in nodes):
                continue
            off = fits(w)
            if off is None:
                continue
            placed.append((w, off))
            ranks.add(w.rank)
            nodes.add(node_of(w.rank))
    return placed


__all__ = [
    "MAX_REPLICAS",
    "REPLICA_PREFIX",
    "ReplicaSlots",
    "check_replicas",
    "client_key",
    "is_replica_key",
    "place",
    "replica_key",
]
