"""The transport contract: how one group of an xcopy moves its bytes.

``xcopy.py`` splits a batch into groups by (source, destination) key (a window's
region and rank, or ``LOCAL_KEY`` for plain local memory), validates every item first,
and then hands each group to the first allowed transport whose ``can_serve`` says yes.

Call order for a transport: ``routes()`` once before the rank joins (descriptors other
ranks need, published in the member record); ``register_window(buffer)`` for each of
this rank's windows; then any number of ``can_serve`` / ``submit`` from any thread;
``close()`` once at leave. ``submit`` may assume the group is valid (ranges inside their
windows, sizes > 0); with ``sync=True`` the bytes are in place when it returns, else it
returns a :class:`Completion`, a :class:`kvfabric.status.Handle` of one item (the group),
to poll. A failure raises ``TransferFailed`` naming the ranks and sizes (from ``submit``
or from ``Completion.wait``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from kvfabric.status import ItemStatus

if TYPE_CHECKING:
    from kvfabric.platform.base import Platform
    from kvfabric.pool.gva.config import GvaConfig
    from kvfabric.pool.gva.view import View


@dataclass(frozen=True)
class GroupPlan:
    """The items of one (source key, destination key) pair of a batch.

    ``dst``/``src`` hold what the caller gave (local addresses or GVAs); ``dst_off`` /
    ``src_off`` the offsets inside the windows (for a local side: the address again).
    """

    src_key: int
    dst_key: int
    index: np.ndarray  # item positions in the batch
    dst: np.ndarray
    src: np.ndarray
    dst_off: np.ndarray
    src_off: np.ndarray
    nbytes: np.ndarray

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    def __len__(self) -> int:
        return int(self.nbytes.size)


def ok_one() -> np.ndarray:
    """The statuses of a finished group: one item, ``OK``."""
    return np.full(1, ItemStatus.OK, np.int8)


class Completion(abc.ABC):
    """One submitted group: a :class:`kvfabric.status.Handle` of one item.

    ``check()`` never blocks; ``wait(timeout)`` returns ``[OK]`` once the copy finished,
    raises ``TransferFailed`` if it failed (the message names ranks and sizes, which the
    ``XferHandle`` keeps) and ``TimeoutError`` if ``timeout`` expires first (the copy goes
    on; the completion may be waited again). No ``cancel``: a copy cannot be recalled.
    One consumer (the ``XferHandle``) waits."""

    @abc.abstractmethod
    def check(self) -> bool: ...

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> np.ndarray:
        """Block until done; ``TimeoutError`` if ``timeout`` expires first."""


class Done(Completion):
    """A group that finished inside ``submit`` (the synchronous path)."""

    __slots__ = ()

    def check(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> np.ndarray:
        return ok_one()


DONE = Done()


@dataclass(frozen=True)
class TransportContext:
    """What a transport gets from the fabric that owns it."""

    platform: Platform
    config: GvaConfig
    rank: int
    node: str


class Transport(abc.ABC):
    """One way of moving bytes (see module docstring)."""

    name: ClassVar[str]

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx

    def routes(self) -> dict[str, str]:
        """Descriptors to publish in this rank's member record."""
        return {}

    def register_window(self, buffer: object) -> None:
        """Make one of this rank's windows reachable by this transport."""

    def update(self, view: View) -> None:
        """A new view was installed (routes of new ranks, departed ranks)."""

    @abc.abstractmethod
    def can_serve(self, view: View, src_key: int, dst_key: int) -> bool: ...

    @abc.abstractmethod
    def submit(self, view: View, group: GroupPlan, sync: bool) -> Completion: ...

    def close(self) -> None:
        """Release the transport's resources (called once, at leave)."""
