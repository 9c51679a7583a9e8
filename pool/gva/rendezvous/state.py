"""``StoreState``: the data of the single-node rendezvous store, without any I/O.

The server (``server.py``) owns one instance and calls it from its event-loop thread
only, so nothing here locks. Every mutation of one key advances the revision by one and
is appended to a bounded history that ``events_after`` serves watches from; listeners
(the server's waiters) are told about each change. Ephemeral keys carry the id of the
session that owns them; ``drop_session`` deletes them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvfabric.errors import KeyNotFound
from kvfabric.pool.gva.rendezvous.base import Compacted, KeyValue, WatchEvent, decode_int


class _Entry:
    __slots__ = ("owner", "rev", "value")

    def __init__(self, value: bytes, rev: int, owner: int | None) -> None:
        self.value = value
        self.rev = rev
        self.owner = owner


class StoreState:
    """Keys, revisions and change history (see module docstring)."""

    def __init__(self, history: int = 65536) -> None:
        if history < 16:
            raise ValueError(f"history must keep at least 16 revisions, got {history}")
        self.data: dict[str, _Entry] = {}
        self.rev = 0
        self.log: deque[WatchEvent] = deque(maxlen=history)
        self.listeners: list[Callable[[WatchEvent], None]] = []

    # ------------------------------------------------------------------ mutation core
    def _change(self, key: str, value: bytes | None, owner: int | None = None) -> int:
        self.rev += 1
        if value is None:
            self.data.pop(key, None)
        else:
            self.data[key] = _Entry(value, self.rev, owner)
        ev = WatchEvent(key, value, self.rev)
        self.log.append(ev)
        for fn in list(self.listeners):
            fn(ev)
        return self.rev

    # ------------------------------------------------------------------ operations
    def set(self, key: str, value: bytes, owner: int | None) -> int:
        return self._change(key, value, owner)

    def get(self, key: str) -> KeyValue | None:
        e = self.data.get(key)
        return None if e is None else KeyValue(key, e.value, e.rev)

    def add(self, key: str, delta: int) -> int:
        e = self.data.get(key)
        n = decode_int(None if e is None else e.value, key) + delta
        self._change(key, str(n).encode("ascii"), None if e is None else e.owner)
        return n

    def append(self, key: str, value: bytes) -> int:
        e = self.data.get(key)
        new = (b"" if e is None else e.value) + value
        self._change(key, new, None if e is None else e.owner)
        return len(new)

    def cas(self, key: str, expected: bytes | None, value: bytes | None) -> tuple[bool, bytes | None]:
        e = self.data.get(key)
        current = None if e is None else e.value
        if current != expected:
            return False, current
        if value is None and e is None:
            return True, None
        self._change(key, value)
        return True, value

    def delete(self, key: str) -> bool:
        if key not in self.data:
            return False
        self._change(key, None)
        return True

    def delete_prefix(self, prefix: str) -> int:
        keys = [k for k in self.data if k.startswith(prefix)]
        for k in sorted(keys):
            self._change(k, None)
        return len(keys)

    def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        out = [KeyValue(k, e.value, e.rev) for k, e in self.data.items() if k.startswith(prefix)]
        out.sort(key=lambda kv: kv.key)
        return out, self.rev

    def events_after(self, prefix: str, after: int) -> list[WatchEvent]:
        """Changes under ``prefix`` with revision > ``after``; ``Compacted`` if forgotten."""
        if after >= self.rev:
            return []
        if not self.log or self.log[0].revision > after + 1:
            raise Compacted(
                f"revision {after + 1} is no longer kept (oldest kept: "
                f"{self.log[0].revision if self.log else self.rev + 1}); re-read with range()"
            )
        out: list[WatchEvent] = []
        for ev in reversed(self.log):
            if ev.revision <= after:
                break
            if ev.key.startswith(prefix):
                out.append(ev)
        out.reverse()
        return out

    def drop_session(self, owner: int) -> int:
        """Delete every ephemeral key of session ``owner``; how many."""
        keys = sorted(k for k, e in self.data.items() if e.owner == owner)
        for k in keys:
            self._change(k, None)
        return len(keys)

    def require(self, key: str) -> KeyValue:
        kv = self.get(key)
        if kv is None:
            raise KeyNotFound(f"rendezvous key {key!r} does not exist")
        return kv
