"""Exceptions shared by every layer of kvfabric.

Contract: bad arguments raise the built-in ``ValueError`` / ``TypeError``; expected
failures at run time raise a subclass of :class:`KVFabricError` whose message names what
failed (sizes, addresses, media, device, key) and which is chained with ``from`` to the
backend error that caused it. This module is a leaf: it imports nothing of kvfabric, so
the platform layer may use it without depending on any layer above it.
"""

from __future__ import annotations


class KVFabricError(Exception):
    """Base class of every expected kvfabric failure."""


class PlatformError(KVFabricError):
    """A device runtime call failed (allocation, copy, stream, IPC)."""


class OutOfSpace(KVFabricError):
    """An allocation did not fit: device memory, a shared-memory cap, or a pool window."""


class KeyNotFound(KVFabricError):
    """A key or block id is not present (or not readable yet)."""


class CorruptObject(KeyNotFound):
    """Bytes read do not match the checksum their writer recorded: served as a miss.

    A subclass of :class:`KeyNotFound` so that every caller that turns a missing object
    into a miss (a recompute, for an engine) does the same with a corrupt one."""


class TransferFailed(KVFabricError):
    """Bytes could not be moved: a copy, an xcopy or a store transfer failed."""


class ServiceUnavailable(KVFabricError):
    """A service (meta service, rendezvous store, remote rank) did not answer in time."""


class LeaseExpired(KVFabricError):
    """A lease ran out before the operation that held it finished."""


class HandleError(PlatformError):
    """An IPC handle could not be decoded, or refers to memory that is gone."""


class RankUnavailable(TransferFailed):
    """A copy names a pool rank that is not (or no longer) in the segment table."""


class StaleSegmentTable(KVFabricError):
    """An address was computed under a segment table that has changed since for that rank."""


__all__ = [
    "CorruptObject",
    "HandleError",
    "KVFabricError",
    "KeyNotFound",
    "LeaseExpired",
    "OutOfSpace",
    "PlatformError",
    "RankUnavailable",
    "ServiceUnavailable",
    "StaleSegmentTable",
    "TransferFailed",
]
