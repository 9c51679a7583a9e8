"""The rendezvous key-value contract every membership store implements.

Keys are ``str``, values ``bytes``. Every mutation advances one store-wide **revision**
(an int that only grows); each key remembers the revision of its last change, so a
reader can wait for "anything newer than what I saw" with :meth:`KVStore.watch`.

Contract (all methods thread-safe; any thread may call any method):

* ``set(key, value, ephemeral=False)``: store ``value``. An *ephemeral* key belongs to
  this client's session and is deleted by the store when the session ends: ``close()``,
  the process dying (the connection drops), or the client missing its heartbeats/lease
  for ``ttl`` seconds. This is how a rank that disappears is noticed.
* ``get(key, timeout=0.0)``: the value, waiting up to ``timeout`` seconds (``None``:
  forever) for the key to exist; ``KeyNotFound`` when it still does not.
* ``try_get(key)``: ``KeyValue`` (value + revision) or ``None``, never blocks.
* ``add(key, delta)``: atomic integer add (a missing key counts as 0, values are decimal
  ASCII); returns the new value.
* ``append(key, value)``: atomic append (a missing key counts as empty); returns the new
  length in bytes.
* ``cas(key, expected, value)``: replace the value only if it is ``expected`` (``None``:
  only if the key is absent); ``value=None`` deletes. Returns ``(swapped, current)``
  where ``current`` is the value after the call.
* ``delete(key)`` / ``delete_prefix(prefix)``: remove; return whether / how many.
* ``range(prefix)``: every key under ``prefix`` and the store revision they were read at.
* ``watch(prefix, after, timeout)``: the changes (``WatchEvent``, ``value=None`` for a
  deletion) of keys under ``prefix`` with revision ``> after``, in revision order,
  waiting up to ``timeout`` seconds for at least one; ``([], revision)`` on timeout.
  ``Compacted`` when the store no longer remembers revision ``after + 1`` (re-read with
  ``range`` and watch from its revision).

Failures to reach the store raise ``ServiceUnavailable``; a lost session (ephemeral keys
gone) makes every later call raise it too (``session_lost`` is then True). The base class
keeps that state for every client: ``_lost`` (why the session ended, set once by the
client; ``close`` sets it too), ``_closed`` (its owner closed it: not a loss) and
``_check_session()``, which a client calls before each request.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from kvfabric.errors import KVFabricError, ServiceUnavailable


class Compacted(ServiceUnavailable):
    """A watch asked for revisions the store no longer keeps."""


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    revision: int


@dataclass(frozen=True)
class WatchEvent:
    key: str
    value: bytes | None  # None: the key was deleted
    revision: int


def check_key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"a rendezvous key is a str, got {type(key).__name__}")
    if not key:
        raise ValueError("a rendezvous key must not be empty")
    return key


def check_value(value: object) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"a rendezvous value is bytes, got {type(value).__name__}")
    return bytes(value)


class KVStore(abc.ABC):
    """A rendezvous store (see the module docstring for the contract)."""

    url: str
    _lost: str | None = None  # why the session ended (the first reason), None while it holds
    _closed: bool = False  # closed by its owner (the session did not get lost)

    def _check_session(self) -> None:
        """``ServiceUnavailable`` naming why, once the session has ended."""
        if self._lost is not None:
            raise ServiceUnavailable(f"{self.url}: {self._lost}")

    @abc.abstractmethod
    def set(self, key: str, value: bytes, *, ephemeral: bool = False) -> int:
        """Store ``value``; returns the revision of the change."""

    @abc.abstractmethod
    def get(self, key: str, timeout: float | None = 0.0) -> bytes: ...

    @abc.abstractmethod
    def try_get(self, key: str) -> KeyValue | None: ...

    @abc.abstractmethod
    def add(self, key: str, delta: int = 1) -> int: ...

    @abc.abstractmethod
    def append(self, key: str, value: bytes) -> int: ...

    @abc.abstractmethod
    def cas(self, key: str, expected: bytes | None, value: bytes | None) -> tuple[bool, bytes | None]: ...

    @abc.abstractmethod
    def delete(self, key: str) -> bool: ...

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int: ...

    @abc.abstractmethod
    def range(self, prefix: str) -> tuple[list[KeyValue], int]: ...

    @abc.abstractmethod
    def watch(self, prefix: str, after: int, timeout: float | None) -> tuple[list[WatchEvent], int]: ...

    @property
    def session_lost(self) -> bool:
        """True once the session ended by itself (not by ``close``): its ephemeral keys are gone."""
        return self._lost is not None and not self._closed

    @abc.abstractmethod
    def close(self) -> None:
        """End the session (its ephemeral keys are deleted) and release connections."""

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def decode_int(raw: bytes | None, key: str) -> int:
    if raw is None or raw == b"":
        return 0
    try:
        return int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"key {key!r} does not hold an integer (got {raw[:32]!r})") from None


__all__ = [
    "Compacted",
    "KVFabricError",
    "KVStore",
    "KeyValue",
    "ServiceUnavailable",
    "WatchEvent",
    "check_key",
    "check_value",
    "decode_int",
]
