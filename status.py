"""One vocabulary for asynchronous work: per-item :class:`ItemStatus` and the :class:`Handle`.

Every layer that reports an outcome per item (a pool key of an RPC batch, a piece of an
xcopy, a block of a store load or dump) writes an ``ItemStatus`` into an ``int8`` array,
and every object that stands for work in flight (an xcopy's ``XferHandle``, a
transport's ``Completion``, a store ``Task``, the Delegator's ``DumpOp`` / ``LoadOp``)
is a :class:`Handle`. The values are stable within one install (they travel in the
pool's RPC status arrays; client and daemon come from the same install) and one value
has one meaning everywhere; the old names of other layers are enum aliases
(``NOT_FOUND`` is ``MISSING``, ``TRANSFER_FAILED`` is ``FAILED``).

Classes of statuses (the helpers work on one status or a whole array):

* *success* (:func:`succeeded`): ``OK``, and ``EXISTS`` (a put-if-absent that found the
  key stored: the bytes are there).
* *miss* (``MISSING``): nothing to read under the key; not an error of the operation.
* *failure* (:func:`failed`): every other final status (``FAILED``, ``CORRUPT``,
  ``NO_SPACE``, ``LEASE_EXPIRED``, ``INVALID``, ``UNAVAILABLE``, ``CANCELLED``,
  ``TIMEOUT``).
* ``PENDING``: not finished; seen only through a live view, never returned by ``wait``.

This module imports nothing from kvfabric (a leaf every layer may use).
"""

from __future__ import annotations

import enum
import time
from typing import Any, Protocol, runtime_checkable

import numpy as np


class ItemStatus(enum.IntEnum):
    """Per-item outcome of a pool RPC, an xcopy or a store load / dump (see module docstring)."""

    OK = 0
    EXISTS = 1  # put of a key that is already stored (or being stored): left untouched
    MISSING = 2  # no readable object / shard under this key
    NO_SPACE = 3  # nothing fits even after eviction (or the directory is full)
    LEASE_EXPIRED = 4  # a write or read lease ran out before the operation finished
    INVALID = 5  # bad key or size (the message names which)
    FAILED = 6  # the bytes could not be moved: I/O or transfer error, backing service gone
    UNAVAILABLE = 7  # the meta service did not answer
    CORRUPT = 8  # the bytes do not match their writer's checksum (a failure, never a hit)
    CANCELLED = 9  # stopped by ``cancel`` before it finished
    TIMEOUT = 10  # stopped because a deadline passed before it finished
    PENDING = 11  # not finished (a live view only; never returned by ``wait``)

    # the pool's former names of the same meanings
    NOT_FOUND = 2
    TRANSFER_FAILED = 6

    @property
    def is_final(self) -> bool:
        """Everything but ``PENDING``."""
        return self is not ItemStatus.PENDING

    @property
    def is_success(self) -> bool:
        """``OK`` or ``EXISTS``: the bytes are where the operation was to put them."""
        return self in _SUCCESS

    @property
    def is_failure(self) -> bool:
        """A final status that is neither a success nor a miss."""
        return bool(_FAILURE_TABLE[self])


_SUCCESS = frozenset((ItemStatus.OK, ItemStatus.EXISTS))
_TABLE_SIZE = 128  # every int8 value >= 0; statuses are small non-negative numbers
_FINAL_TABLE = np.ones(_TABLE_SIZE, bool)
_FINAL_TABLE[ItemStatus.PENDING] = False
_SUCCESS_TABLE = np.zeros(_TABLE_SIZE, bool)
_SUCCESS_TABLE[[int(s) for s in _SUCCESS]] = True
_FAILURE_TABLE = _FINAL_TABLE & ~_SUCCESS_TABLE
_FAILURE_TABLE[ItemStatus.MISSING] = False
_FAILURE_TABLE[len(ItemStatus) :] = True  # a value this install does not know is a failure

#: the statuses a KV block store reports per block (``docs/stores.md``), in value order
BLOCK_STATUSES: tuple[ItemStatus, ...] = (
    ItemStatus.OK,
    ItemStatus.MISSING,
    ItemStatus.FAILED,
    ItemStatus.CORRUPT,
    ItemStatus.CANCELLED,
    ItemStatus.TIMEOUT,
    ItemStatus.PENDING,
)


def _lookup(table: np.ndarray, status: Any) -> Any:
    arr = np.asarray(status)
    if arr.ndim == 0:
        return bool(table[int(arr)])
    return table[arr.astype(np.intp)]


def finished(status: Any) -> Any:
    """Which of ``status`` (one status or an array) are final: a bool or a bool mask."""
    return _lookup(_FINAL_TABLE, status)


def succeeded(status: Any) -> Any:
    """Which of ``status`` are ``OK`` or ``EXISTS``: a bool or a bool mask."""
    return _lookup(_SUCCESS_TABLE, status)


def failed(status: Any) -> Any:
    """Which of ``status`` are failures (final, neither a success nor ``MISSING``)."""
    return _lookup(_FAILURE_TABLE, status)


def counts(status: np.ndarray) -> np.ndarray:
    """How many items of ``status`` have each value: an array indexed by ``ItemStatus``."""
    return np.bincount(np.asarray(status, np.int64).reshape(-1), minlength=len(ItemStatus))[: len(ItemStatus)]


def pending(n: int) -> np.ndarray:
    """A fresh ``(n,)`` int8 status array, every item ``PENDING``."""
    return np.full(n, ItemStatus.PENDING, np.int8)


@runtime_checkable
class Handle(Protocol):
    """Work in flight whose outcome is a per-item :class:`ItemStatus` array.

    Contract:

    * ``check() -> bool``: whether the work has finished (well or not). Never blocks; it
      may advance bookkeeping (collect finished parts), so it may be called in a loop.
    * ``wait(timeout=None) -> np.ndarray``: block until the work finished and return the
      ``(n,)`` int8 statuses, one per item, none ``PENDING``. Failures are statuses, not
      exceptions (a transport ``Completion``, one item, raises ``TransferFailed`` instead,
      which its ``XferHandle`` turns into ``FAILED`` items). If ``timeout`` seconds pass
      first, ``wait`` raises ``TimeoutError`` and changes nothing: the work goes on and the
      handle may be checked or waited again. Once ``wait`` returned the statuses, whether a
      second ``wait`` is allowed is the implementation's (store tasks and Delegator ops:
      a ``ValueError``; an ``XferHandle`` returns the same array).
    * ``cancel()``, where an implementation has it (store tasks, Delegator ops; not
      xcopy, whose copies cannot be recalled): stop what has not started; when it
      returns, nothing more touches the caller's memory, and a following ``wait``
      returns promptly with the stopped items ``CANCELLED``. :func:`wait_or_cancel` is
      "wait with a deadline, then cancel" (the store API's ``wait(task, timeout)``).

    Threads: any thread may ``check``; one consumer waits on (and cancels) a handle.
    Memory: the caller's buffers named by the work belong to the work until ``wait``
    returned.
    """

    def check(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> np.ndarray: ...


def wait_or_cancel(handle: Any, timeout: float | None) -> np.ndarray:
    """``handle.wait(timeout)``; if the deadline passes first, cancel the handle and return
    its statuses with the items the cancel stopped reading ``TIMEOUT``. ``handle`` must
    have ``cancel()``."""
    try:
        return handle.wait(timeout)
    except TimeoutError:
        pass
    handle.cancel()
    out = np.array(handle.wait(), np.int8)
    out[out == ItemStatus.CANCELLED] = ItemStatus.TIMEOUT
    return out


def poll_until(check: Any, timeout: float | None) -> bool:
    """Call ``check()`` until it is True (backing off to 1 ms) or ``timeout`` seconds passed;
    its last answer. For handles without a condition variable to wait on."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 1e-5
    while not check():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 1.5, 1e-3)
    return True


__all__ = [
    "BLOCK_STATUSES",
    "Handle",
    "ItemStatus",
    "counts",
    "failed",
    "finished",
    "pending",
    "poll_until",
    "succeeded",
    "wait_or_cancel",
]
