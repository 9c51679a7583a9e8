"""The store contract: one asynchronous API that every KV block store implements.

A store holds *block shards*: the bytes of one shard (``shard_idx``) of one block
(a 16-byte id). Ids travel as an ``(n, 16)`` uint8 array; the bytes of a shard are ``m``
pieces whose sizes the store is configured with (``StoreLayout.piece_sizes``), and the
caller names where those pieces are with an ``(n, m)`` uint64 array of addresses known to
the store's platform (allocated, registered or wrapped there), so one call costs O(1)
Python work whatever ``n`` is. A store moves bytes only through its platform (copies,
batched copies, streams), so the addresses may be device memory.

Call order and meaning (every method is thread-safe):

* ``lookup(ids) -> (n,) bool``: which blocks are present *and complete* in this store
  (every shard of the block; with one shard per block, that shard).
* ``lookup_prefix(ids) -> int``: the length of the present prefix (ids are a chain).
* ``prefetch(ids)``: best effort hint that these may be loaded soon; may do nothing.
* ``load(ids, shard_idx, addrs) -> Task``: copy present shards into ``addrs``; absent
  ones are reported ``MISSING`` and their destination is left untouched.
* ``dump(ids, shard_idx, addrs, after=None) -> Task``: store the shards at ``addrs``;
  the copy starts only once ``after`` (a platform ``Event``) has completed. A shard that
  is already present is left untouched and reported ``OK`` (stores are put-if-absent).
* ``check(task) -> bool``: whether ``task`` has finished (never blocks).
* ``wait(task, timeout=None) -> (n,) ItemStatus``: block until ``task`` finishes and
  return the status of each block. One consumer: a second ``wait`` on the same task is a
  ``ValueError``. On timeout the task is cancelled cleanly (blocks not finished are
  ``TIMEOUT``; a cancelled dump leaves nothing visible) and the statuses are returned;
  ``wait`` then returns after at most the copy into or out of the caller's memory that
  was already running (such a copy cannot be recalled), never after slower work such as
  file I/O, which goes on privately and is discarded.
* ``cancel(task)``: stop what has not started; unfinished blocks become ``CANCELLED``.
  The caller still calls ``wait`` to collect the statuses.
* ``close()``: let outstanding tasks finish (for a grace period; tasks still running then
  are cancelled), then release buffers, streams and threads. Idempotent; any later call
  is a ``ValueError``.

The metadata side alone (``lookup``, ``lookup_prefix``, ``close``) is an :class:`Index`:
what a scheduler in another process gets for the same store (``index.py``).

Memory ownership: the caller owns the memory at ``addrs``. After a ``load`` it must not
read, and after a ``dump`` it must not overwrite, those bytes until ``wait`` returned:
for a dump, ``wait`` returning means "the source buffers may be reused" (even if the
store writes behind). Visibility: a shard becomes visible to ``lookup`` only once it is
complete and durable in this store; no torn shard is ever visible, even if the writer
dies in the middle of a dump.

Errors: malformed arguments (shapes, dtypes, unknown shard index, an ``after`` that is
not an event of the store's platform, addresses whose pieces do not lie inside the
platform's buffers at the configured piece sizes) raise ``ValueError`` / ``TypeError``
at the call, before anything is queued; failures while moving bytes never raise from
``wait`` but show up as per-block statuses (``FAILED``); a backing service that does
not answer makes ``lookup`` report a miss. Using a closed store is a ``ValueError``.

Tasks are handles (:class:`kvfabric.status.Handle`) too: ``task.check()``,
``task.wait(timeout)`` (a timeout raises ``TimeoutError`` and leaves the task waitable)
and ``task.cancel()``.
Statuses are :class:`kvfabric.status.ItemStatus` values (``BlockStatus`` is that enum;
``kvfabric.status.BLOCK_STATUSES`` the ones a store reports).

Integrity: every store that keeps bytes outside the caller seals each shard with its
writer's checksum (``kvfabric.platform.checksum``) and, with the store's ``verify`` on,
checks it before a load counts: a mismatch is ``CORRUPT`` for that block (a failure like
``FAILED``, kept apart so callers can count it), the store drops its copy (so the next
dump writes it again), counts it in ``stats()["corrupt_blocks"]`` and logs once. The
destination of a ``CORRUPT`` block may hold the bad bytes: like any failure, it must not
be used.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from kvfabric.platform.checksum import Verify
from kvfabric.platform.stream import Event
from kvfabric.status import ItemStatus, poll_until

if TYPE_CHECKING:
    from kvfabric.platform.base import Platform

ID_BYTES = 16


#: per-block outcome of a load or dump: the one per-item vocabulary of kvfabric
#: (``kvfabric.status``); a store reports ``OK``, ``MISSING`` (load: the shard is not in
#: this store), ``FAILED`` (I/O or transfer error, out of space, backing service gone),
#: ``CORRUPT`` (load: the bytes do not match their writer's checksum; a failure, never a
#: hit), ``CANCELLED``, ``TIMEOUT``, and ``PENDING`` (not finished: only seen through a
#: task's live view, never from ``wait``); ``kvfabric.status.BLOCK_STATUSES`` lists them
BlockStatus = ItemStatus


class TaskKind(enum.Enum):
    LOAD = "load"
    DUMP = "dump"


@dataclass(frozen=True)
class StoreLayout:
    """How many shards a block has and the byte sizes of the pieces of one shard."""

    piece_sizes: tuple[int, ...]
    num_shards: int = 1

    def __post_init__(self) -> None:
        try:
            sizes = tuple(int(s) for s in self.piece_sizes)
        except (TypeError, ValueError):
            raise TypeError(f"piece_sizes must be a sequence of ints, got {self.piece_sizes!r}") from None
        if not sizes or any(s <= 0 for s in sizes):
            raise ValueError(f"piece_sizes must be positive byte counts, got {self.piece_sizes!r}")
        object.__setattr__(self, "piece_sizes", sizes)
        if isinstance(self.num_shards, bool) or not isinstance(self.num_shards, int) or self.num_shards < 1:
            raise ValueError(f"num_shards must be an int >= 1, got {self.num_shards!r}")

    @property
    def shard_bytes(self) -> int:
        return int(sum(self.piece_sizes))

    @property
    def pieces(self) -> int:
        return len(self.piece_sizes)

    @property
    def offsets(self) -> np.ndarray:
        """``(m,)`` uint64 byte offsets of the pieces inside a contiguous shard."""
        sizes = np.asarray(self.piece_sizes, np.uint64)
        return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64)

    @property
    def sizes(self) -> np.ndarray:
        """``(m,)`` uint64 piece sizes."""
        return np.asarray(self.piece_sizes, np.uint64)


def check_ids(ids: Any) -> np.ndarray:
    """Validate and return ids as a C-contiguous ``(n, 16)`` uint8 array."""
    arr = np.asarray(ids)
    if arr.dtype != np.uint8 or arr.ndim != 2 or arr.shape[1] != ID_BYTES:
        raise ValueError(f"ids must be an (n, {ID_BYTES}) uint8 array, got {arr.dtype} {arr.shape}")
    return np.ascontiguousarray(arr)


def check_addrs(addrs: Any, n: int, layout: StoreLayout) -> np.ndarray:
    """Validate and return addresses as a C-contiguous ``(n, m)`` uint64 array."""
    arr = np.asarray(addrs)
    if arr.ndim == 1 and layout.pieces == 1:
        arr = arr.reshape(-1, 1)
    if arr.ndim != 2 or arr.shape != (n, layout.pieces):
        raise ValueError(
            f"addrs must have shape ({n}, {layout.pieces}) (blocks x pieces per shard), got {arr.shape}"
        )
    if arr.dtype != np.uint64:
        if arr.dtype.kind not in "iu" or (arr.size and int(arr.min()) < 0):
            raise ValueError(f"addrs must be non-negative integer addresses, got {arr.dtype}")
        arr = arr.astype(np.uint64)
    return np.ascontiguousarray(arr)


def check_ranges(platform: Platform, addrs: np.ndarray, layout: StoreLayout) -> np.ndarray:
    """Check that every piece ``addrs[i, j] .. + piece_sizes[j]`` lies inside one live buffer
    of ``platform``; return the ``(n, m)`` medium codes (0 DRAM, 1 HBM). Vectorised."""
    sizes = np.broadcast_to(np.asarray(layout.piece_sizes, np.uint64), addrs.shape)
    try:
        return platform.media_of(addrs, sizes, "piece").reshape(addrs.shape)
    except ValueError:
        pass
    for (i, j), ptr in np.ndenumerate(addrs):  # error path only: name the first stray piece
        try:
            platform.find(int(ptr), int(layout.piece_sizes[j]))
        except ValueError:
            raise ValueError(
                f"block {i}, piece {j}: {layout.piece_sizes[j]} B at {int(ptr):#x} is not inside any "
                f"live buffer of {platform!r} (the layout's piece sizes are {list(layout.piece_sizes)})"
            ) from None
    raise ValueError("addrs do not lie inside the platform's buffers")  # pragma: no cover


def check_after(after: Any, platform: Platform) -> Event | None:
    """``after`` must be None or an ``Event`` of ``platform``."""
    if after is None:
        return None
    if not isinstance(after, Event) or after.platform is not platform:
        raise TypeError(f"after must be None or an Event of {platform!r}, got {type(after).__name__}")
    return after


def check_shard(shard_idx: int, layout: StoreLayout) -> int:
    if isinstance(shard_idx, bool) or not isinstance(shard_idx, (int, np.integer)):
        raise TypeError(f"shard_idx must be an int, got {type(shard_idx).__name__}")
    if not 0 <= shard_idx < layout.num_shards:
        raise ValueError(f"shard_idx {shard_idx} out of range: the layout has {layout.num_shards} shard(s)")
    return int(shard_idx)


def present_prefix(mask: np.ndarray) -> int:
    """The length of the run of True at the start of a lookup mask."""
    misses = np.flatnonzero(~mask)
    return int(misses[0]) if misses.size else int(mask.size)


@runtime_checkable
class Index(Protocol):
    """The read-only metadata side of a store: which blocks are present, nothing else.

    What a scheduler needs to count hits without moving bytes: no buffers, no copy threads,
    no data-path connection (``kvfabric.ucm_layer.store.index``; ``registry.create_index``
    builds the one of a spec). ``lookup`` and ``lookup_prefix`` mean what they mean on a
    :class:`Store` (present *and complete*, in the same store the workers' movers write),
    and a backing service that does not answer is a miss; ``close()`` releases what the
    index holds (idempotent). Every :class:`Store` is also an index (the one of its own
    process, including its private tiers). Thread-safe."""

    def lookup(self, ids: np.ndarray) -> np.ndarray: ...

    def lookup_prefix(self, ids: np.ndarray) -> int: ...

    def close(self) -> None: ...


class Task(abc.ABC):
    """A handle on one load or dump. Only the store that made it (``store``) may be asked
    about it.

    A task is a :class:`kvfabric.status.Handle`: ``check()`` is ``store.check(task)``;
    ``wait(timeout)`` returns ``store.wait(task)`` once the task finished, and if
    ``timeout`` seconds pass first raises ``TimeoutError`` and leaves the task running
    and waitable (the store API's ``store.wait(task, timeout)`` cancels instead: it is
    ``kvfabric.status.wait_or_cancel(task, timeout)``); ``cancel()`` is
    ``store.cancel(task)``. Single consumer, as for ``store.wait``."""

    kind: TaskKind
    num_blocks: int
    #: the store that made this task
    store: Store

    def check(self) -> bool:
        """Whether the task has finished (never blocks)."""
        return self.store.check(self)

    def wait_finished(self, timeout: float | None) -> bool:
        """Block until the task finished or ``timeout`` passed; whether it finished. Does
        not consume the task (the default polls ``check``)."""
        return poll_until(self.check, timeout)

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """The ``(n,)`` statuses once the task finished; ``TimeoutError`` (task untouched)
        if ``timeout`` seconds pass first."""
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout}")
        if not self.wait_finished(timeout):
            raise TimeoutError(f"{self!r} not finished after {timeout} s")
        return self.store.wait(self)

    def cancel(self) -> None:
        """``store.cancel(task)``: unfinished blocks become ``CANCELLED``; ``wait`` collects."""
        self.store.cancel(self)


class Store(abc.ABC):
    """A KV block store (see the module docstring for the contract)."""

    #: the name this store is registered under (``"posix"``, ``"cache"``, ``"pool"``)
    name: str = "abstract"

    layout: StoreLayout
    #: the platform whose buffers ``addrs`` point into (the caller owns it)
    platform: Platform

    @abc.abstractmethod
    def lookup(self, ids: np.ndarray) -> np.ndarray: ...

    def lookup_prefix(self, ids: np.ndarray) -> int:
        return present_prefix(self.lookup(ids))

    def prefetch(self, ids: np.ndarray) -> None:
        """Best effort; the default does nothing."""

    @abc.abstractmethod
    def load(self, ids: np.ndarray, shard_idx: int, addrs: np.ndarray) -> Task: ...

    @abc.abstractmethod
    def dump(self, ids: np.ndarray, shard_idx: int, addrs: np.ndarray, after: Any = None) -> Task: ...

    @abc.abstractmethod
    def check(self, task: Task) -> bool: ...

    @abc.abstractmethod
    def wait(self, task: Task, timeout: float | None = None) -> np.ndarray: ...

    @abc.abstractmethod
    def cancel(self, task: Task) -> None: ...

    def set_verify(self, verify: Verify | str | bool) -> None:
        """Switch whether loads check the writers' checksums (``on`` / ``off``; for benchmarks
        and negative controls, between tasks). The default: nothing is kept to verify."""

    def stats(self) -> dict[str, int]:
        """Counters since start (blocks and bytes loaded / dumped / missed / failed ...)."""
        return {}

    def close(self) -> None:
        """Finish or cancel outstanding tasks and release resources. Idempotent."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any], **kwargs: Any) -> Store:
        """Build from one flat config mapping; each store validates its own keys."""
        raise NotImplementedError(f"store {cls.name!r} has no from_config")

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
