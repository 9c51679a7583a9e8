"""Barrier and all-gather on any :class:`KVStore`, with keys that are cleaned up.

A :class:`Group` is ``world`` participants that call the same collectives in the same
order; call ``k`` uses the keys under ``{name}/{k}/``:

* ``barrier``: ``add(arrive, 1)``; the participant that brings the count to ``world``
  sets ``open``; everyone waits for ``open`` with a blocking ``get``.
* ``all_gather``: each participant ``append``s one length-prefixed record to ``data``
  and waits (``watch``) until ``world`` records are there; results come back ordered by
  rank.

Either way each participant then ``add``s to ``leave``; the last one out deletes the
call's keys, so nothing accumulates in the store. A participant that does not arrive
within ``timeout`` makes the others raise ``ServiceUnavailable`` naming the call.
"""

from __future__ import annotations

import struct
import time

from kvfabric.errors import KeyNotFound, ServiceUnavailable
from kvfabric.pool.gva.rendezvous.base import KVStore

_REC = struct.Struct(">II")


class Group:
    """``world`` participants of one named group; this one is ``rank`` (0-based)."""

    def __init__(self, store: KVStore, name: str, rank: int, world: int, timeout: float = 60.0) -> None:
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"need 0 <= rank < world and world >= 1, got rank {rank}, world {world}")
        if not name or not isinstance(name, str):
            raise ValueError(f"a group name is a non-empty str, got {name!r}")
        self.store, self.name, self.rank, self.world = store, name.rstrip("/"), rank, world
        self.timeout = float(timeout)
        self.seq = 0

    def _next(self) -> str:
        self.seq += 1
        return f"{self.name}/{self.seq}/"

    def _leave(self, base: str) -> None:
        if self.store.add(base + "leave", 1) == self.world:
            self.store.delete_prefix(base)

    def barrier(self) -> None:
        """Return once all ``world`` participants have entered this barrier."""
        base = self._next()
        if self.store.add(base + "arrive", 1) == self.world:
            self.store.set(base + "open", b"1")
        try:
            self.store.get(base + "open", timeout=self.timeout)
        except KeyNotFound as e:
            raise ServiceUnavailable(
                f"barrier {base!r}: not all {self.world} participants arrived within {self.timeout} s"
            ) from e
        self._leave(base)

    def all_gather(self, value: bytes) -> list[bytes]:
        """Every participant's ``value``, indexed by rank."""
        base = self._next()
        key = base + "data"
        self.store.append(key, _REC.pack(self.rank, len(value)) + bytes(value))
        deadline = time.monotonic() + self.timeout
        while True:
            kv = self.store.try_get(key)
            got = _parse(kv.value if kv else b"")
            if len(got) >= self.world:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServiceUnavailable(
                    f"all_gather {base!r}: {len(got)} of {self.world} participants arrived "
                    f"within {self.timeout} s"
                )
            self.store.watch(key, kv.revision if kv else 0, left)
        self._leave(base)
        return [got[r] for r in range(self.world)]


def _parse(data: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    pos = 0
    while pos + _REC.size <= len(data):
        rank, n = _REC.unpack_from(data, pos)
        pos += _REC.size
        out[rank] = data[pos : pos + n]
        pos += n
    return out
