"""``FabricDataPlane``: how a pool client moves object bytes — through the GVA fabric.

Every process of a pool is a rank of one :class:`~kvfabric.pool.gva.fabric.Fabric`
(``pool.gva``): windows on this node are mapped here, windows on other nodes are reached
through the fabric's remote transport. The pool's GVAs are the fabric's (its strides are
pinned, so an address in the directory never changes meaning).

* ``local(gva, n)``: the mapped address of a range, or None when it lives on another node
  (the single-piece read fast path copies from there with a plain memmove);
* ``write`` / ``read``: many pieces between caller memory and GVAs in one
  ``batch_xcopy`` (grouped by rank pair, mapped or remote); per-piece success comes back
  so a batch fails only the objects whose pieces failed;
* ``write_one`` / ``read_one``: one piece; a plain memmove when both sides are host memory,
  the GVA is mapped here and the piece is below ``ONE_COPY_BYTES`` (the copy machinery costs
  tens of µs, a fifth of a MiB's copy), else ``write`` / ``read`` (where the platform may
  split a large copy across threads);
* ``check_user_one``: the caller's range must lie in a buffer its platform knows.

Thread-safe (the fabric is).
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvfabric.errors import RankUnavailable, TransferFailed
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.types import CopyBatch, Medium
from kvfabric.pool.gva.address import REGION_MEDIUM, region_of
from kvfabric.pool.gva.fabric import Fabric, FabricState
from kvfabric.pool.gva.handle import ItemStatus

ONE_COPY_BYTES = 4 << 20  # from here on a platform copy may split the piece across threads


class FabricDataPlane:
    """See module docstring."""

    def __init__(self, fabric: Fabric) -> None:
        self.fab = fabric
        self.platform = fabric.platform
        self._user_hit: tuple[Buffer, int, int, bool] | None = None
        self._host = {m: self.platform.host_addressable(m) for m in Medium}

    def local(self, gva: int, n: int) -> tuple[int, bool] | None:
        """``(address, host-addressable)`` of a range mapped here, else None."""
        try:
            ptr = self.fab.local_address(gva, n)
        except RankUnavailable:
            return None
        return ptr, self._host[REGION_MEDIUM[region_of(gva)]]

    def write(self, gvas: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Copy caller pieces to GVAs; per-piece success (bool array)."""
        return self._xcopy(gvas, srcs, sizes)

    def write_one(self, gva: int, ptr: int, n: int, host_user: bool) -> bool:
        """Copy one caller piece to ``gva``; True when it arrived. Like every copy of the
        fabric, it copies only while this process is still a member: a rank evicted
        meanwhile (its space may belong to other objects by now) writes nothing."""
        near = self._direct(gva, n, host_user) if self.fab.state is FabricState.JOINED else None
        if near is None:
            return bool(self.write(*_one(gva, ptr, n)).all())
        ctypes.memmove(near, ptr, n)
        return True

    def read_one(self, ptr: int, gva: int, n: int, host_user: bool) -> bool:
        """Copy the piece at ``gva`` into caller memory; True when it arrived."""
        near = self._direct(gva, n, host_user)
        if near is None:
            return bool(self.read(*_one(ptr, gva, n)).all())
        ctypes.memmove(ptr, near, n)
        return True

    def _direct(self, gva: int, n: int, host_user: bool) -> int | None:
        """The mapped address of a piece a plain memmove may copy (see module docstring)."""
        if host_user and n < ONE_COPY_BYTES:
            loc = self.local(gva, n)
            if loc is not None and loc[1]:
                return loc[0]
        return None

    def read(self, dsts: np.ndarray, gvas: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Copy GVA pieces into caller memory; per-piece success (bool array)."""
        return self._xcopy(dsts, gvas, sizes)

    def _xcopy(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        if dst.size == 0:
            return np.ones(0, bool)
        try:
            handle = self.fab.batch_xcopy(CopyBatch(dst, src, sizes), inline=True)
        except RankUnavailable:
            return np.zeros(dst.size, bool)  # a rank named by the batch is gone
        return handle.wait() == ItemStatus.OK

    def check_user(self, ptrs: np.ndarray, sizes: np.ndarray) -> bool:
        """Check caller ranges lie in platform buffers; True when all are host-addressable."""
        host = True
        for i, (p, n) in enumerate(zip(ptrs.tolist(), sizes.tolist())):
            try:
                host = self.check_user_one(p, n) and host
            except ValueError as e:
                raise ValueError(f"ptrs[{i}] = {p:#x} (sizes[{i}] = {n}): {e}") from None
        return host

    def check_user_one(self, ptr: int, n: int) -> bool:
        """One caller range (the last buffer found is remembered: callers reuse buffers)."""
        last = self._user_hit
        if last is not None and last[1] <= ptr and ptr + n <= last[2] and not last[0].freed:
            return last[3]
        buf = self.platform.find(ptr, n).buffer
        host = self._host[buf.medium]
        self._user_hit = (buf, buf.ptr, buf.end, host)
        return host


def _one(dst: int, src: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.array([dst], np.uint64), np.array([src], np.uint64), np.array([n], np.uint64)


def require(ok: np.ndarray, what: str) -> None:
    if not ok.all():
        raise TransferFailed(f"{what}: {int((~ok).sum())} of {ok.size} piece(s) could not be copied")
