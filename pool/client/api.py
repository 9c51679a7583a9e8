"""``PoolClient``: put / get / exists / remove, batched and zero-copy, against one pool.

A client talks to the meta service for metadata only (one RPC per batch for alloc, one
for commit; none for reads or ``exists`` on the pool's node) and moves object bytes
itself, as a rank of the pool's GVA fabric (``FabricDataPlane``): windows on this node
are mapped here and copied with plain memory copies; windows elsewhere are reached
through the fabric's remote transport. Reads on the node look keys up in the shared
directory table, copy, and re-check the slot afterwards, so an object removed or evicted
meanwhile is a miss or a retry, never wrong bytes (``reads.py``); writes are in
``writes.py``; both work over the client's ``Session`` (``session.py``: the RPCs, the
fabric rank, the mapped table, catching up with a restarted service).

Keys: a ``str`` (its UTF-8 bytes) or ``bytes`` (binary), 1 to 256 bytes (``keys.py``);
batch calls take a list of them or a :class:`~kvfabric.pool.keys.KeyBatch` (keys of one
width as a uint8 matrix, checked once for the whole batch and sent with no per-key work).

Buffers: zero-copy calls take addresses of memory the client's platform knows
(``register_buffer`` for caller memory, or buffers from ``platform.alloc`` / ``wrap``);
the bytes API (``put`` / ``get``) stages through Python bytes.

Single calls raise typed errors (``KeyNotFound``, ``OutOfSpace``, ``LeaseExpired``,
``TransferFailed``, ``ServiceUnavailable``); batch calls return a per-key ``Status``
array and raise only when the service itself is unreachable. Thread-safe.

``window_bytes``: the client contributes a window of its own as a rank; objects may be
placed in its memory (its own puts first), and it re-registers those objects if the meta
service restarts. ``metadata_only``: no fabric, no data path; only ``exists`` and the
other metadata calls. ``local_reads=False``: read like a client on another node (RPC read
leases), which is also how that path is tested. ``etcd_auth``: TLS / auth settings of an
etcd rendezvous (``rendezvous.etcd.EtcdAuth``); the transport's ``token``, when it has
one, also authenticates the client to a rendezvous server over TCP.

Replicas: ``replicas`` (the client's default for its puts; None: the pool's ``replicas``)
and the ``replicas`` argument of each put ask for that many copies of each object, placed
by the service on distinct nodes (then distinct ranks; fewer when fewer ranks can take
one: ``under_replicated`` counts those puts). A put is readable once every copy is
written; a read takes the copy mapped here first and passes over a copy that fails
(dead rank, changed slot, checksum) to the next (``reads.py``).

Integrity: every object carries its writer's checksum; with ``verify`` on (the pool's
setting unless the client says otherwise) a read counts only once the bytes it copied
match it. A mismatch is a miss (``CorruptObject``, a ``KeyNotFound``; ``Status.CORRUPT``
in batches), counted in ``corrupt`` and logged once; the object is removed so that the
next put rewrites it. Writes stop before their lease runs out (``writes.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvfabric.errors import KeyNotFound, LeaseExpired, OutOfSpace, TransferFailed
from kvfabric.platform.base import Platform
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.checksum import Verify
from kvfabric.platform.procmaps import check_mapped
from kvfabric.platform.types import Medium
from kvfabric.pool import protocol as p
from kvfabric.pool.client.reads import Reader
from kvfabric.pool.client.rpc import Transport
from kvfabric.pool.client.session import ClientOptions, Session
from kvfabric.pool.client.writes import Writer, u64
from kvfabric.pool.keys import Keys, check_int, encode_key, encode_keys, key_text
from kvfabric.pool.status import Status
from kvfabric.pool.table import TableView


class PoolClient:
    """See module docstring. Build with :func:`kvfabric.pool.connect` or an embedded pool."""

    def __init__(
        self,
        transport: Transport,
        platform: Platform,
        *,
        window_bytes: int = 0,
        window_medium: Medium = Medium.DRAM,
        metadata_only: bool = False,
        local_reads: bool = True,
        client_id: str | None = None,
        verify: Verify | str | bool | None = None,
        etcd_auth: Any = None,
        replicas: int | None = None,
    ) -> None:
        token = str(getattr(transport, "token", "") or "")
        if isinstance(getattr(transport, "token", None), bytes):
            token = transport.token.decode()  # type: ignore[attr-defined]
        options = ClientOptions(
            window_bytes,
            window_medium,
            metadata_only,
            local_reads,
            client_id,
            verify,
            token,
            etcd_auth,
            replicas,
        )
        self.session = Session(transport, platform, options)
        self.writer = Writer(self.session)
        self.reader = Reader(self.session)

    # ------------------------------------------------------------------ the session's state
    transport = property(lambda self: self.session.transport)
    platform = property(lambda self: self.session.platform)
    client_id = property(lambda self: self.session.client_id)
    metadata_only = property(lambda self: self.session.metadata_only)
    local_reads = property(lambda self: self.session.local_reads)
    fabric = property(lambda self: self.session.fabric)
    dp = property(lambda self: self.session.dp)
    rank = property(lambda self: self.session.rank)
    addr = property(lambda self: self.session.addr)
    write_lease_s = property(lambda self: self.session.write_lease_s)

    @property
    def table(self) -> TableView | None:
        return self.session.table

    @table.setter
    def table(self, table: TableView | None) -> None:  # a test forcing the RPC read path
        self.session.table = table

    @property
    def verify(self) -> Verify:
        return self.session.verify

    @verify.setter
    def verify(self, verify: Verify) -> None:
        self.session.verify = verify

    def refresh(self) -> None:
        """Re-read the service's state (a restart is noticed and caught up with here)."""
        self.session.refresh()

    def in_own_window(self, gva: int) -> bool:
        return self.session.in_own_window(gva)

    # ------------------------------------------------------------------ metadata
    def exists(self, key: str | bytes) -> bool:
        return bool(self.batch_exists([key])[0])

    def batch_exists(self, keys: Keys) -> np.ndarray:
        kb = encode_keys(keys)
        if self.table is not None:
            return self.session.read(self.reader.exists_local, kb)
        return np.array(self.session.call(p.Exists(kb)).flags, dtype=bool)

    def remove(self, key: str | bytes) -> bool:
        return self.batch_remove([key])[0] == Status.OK

    def batch_remove(self, keys: Keys) -> np.ndarray:
        kb = encode_keys(keys)
        st = np.array(self.session.call(p.Remove(kb)).status, np.int8)
        self.session.owned.forget(kb)
        return st

    def remove_all(self) -> int:
        self.session.owned.forget()
        return int(self.session.call(p.RemoveAll()).data["removed"])

    def info(self) -> dict[str, Any]:
        return dict(self.session.call(p.Info()).data)

    # ------------------------------------------------------------------ buffers
    def register_buffer(self, ptr: int, nbytes: int) -> Buffer:
        """Make caller memory usable by the zero-copy calls (pinned on device platforms).
        ``ValueError`` naming the argument when ``[ptr, ptr + nbytes)`` is not memory mapped
        readable in this process (checked once here, so a bogus address never reaches a copy)."""
        ptr, nbytes = check_int(ptr, "ptr", 1), check_int(nbytes, "nbytes", 1)
        check_mapped(ptr, nbytes, f"register_buffer(ptr={ptr:#x}, nbytes={nbytes})")
        return self.platform.register_host(ptr, nbytes)

    def unregister_buffer(self, buf: Buffer) -> None:
        self.platform.free(buf)

    # ------------------------------------------------------------------ writes
    def batch_alloc(
        self,
        keys: Keys,
        sizes: Sequence[int],
        preferred_rank: int | None = None,
        medium: Medium | None = None,
        replicas: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Space for each key: ``(status, gva)``. Write pieces at ``gva + offset`` with
        :meth:`write` (which copies them into the key's further extents too, with
        ``replicas``), then :meth:`batch_commit`; space not committed within the write
        lease is reclaimed."""
        return self.writer.alloc(encode_keys(keys), sizes, preferred_rank, medium, replicas)

    def write(self, gvas: Any, ptrs: Any, sizes: Any) -> None:
        """Copy caller pieces ``ptrs[i]`` (``sizes[i]`` bytes) to ``gvas[i]``."""
        self.writer.write(gvas, ptrs, sizes)

    def batch_commit(
        self, keys: Keys, ok: Sequence[bool] | None = None, ttl_s: float | None = None
    ) -> np.ndarray:
        return self.writer.batch_commit(encode_keys(keys), ok, ttl_s)

    def batch_put_from_layers(
        self, keys: Keys, ptrs: Any, sizes: Any, replicas: int | None = None
    ) -> np.ndarray:
        """Store each key from ``m`` pieces: ``ptrs`` is ``(k, m)``, ``sizes`` ``(m,)`` or
        ``(k, m)``. One alloc RPC, one batched copy, one commit RPC. Per-key statuses."""
        return self.writer.batch_put_from_layers(encode_keys(keys), ptrs, sizes, replicas)

    def put_from_layers(self, key: str | bytes, ptrs: Any, sizes: Any) -> Status:
        kb = encode_key(key)
        P, S = u64(ptrs, "ptrs")[None, :], u64(sizes, "sizes", positive=True)
        return _raise_put(kb, Status(int(self.writer.batch_put_from_layers([kb], P, S)[0])))

    def batch_put_from(self, keys: Keys, ptrs: Any, sizes: Any, replicas: int | None = None) -> np.ndarray:
        P, S = u64(ptrs, "ptrs")[:, None], u64(sizes, "sizes", positive=True)[:, None]
        return self.writer.batch_put_from_layers(encode_keys(keys), P, S, replicas)

    def put_from(self, key: str | bytes, ptr: int, nbytes: int, replicas: int | None = None) -> Status:
        kb = encode_key(key)
        ptr, nbytes = check_int(ptr, "ptr", 1), check_int(nbytes, "nbytes", 1)
        return _raise_put(kb, self.writer.put_one(kb, ptr, nbytes, replicas))

    def batch_put(self, keys: Keys, values: Sequence[bytes], replicas: int | None = None) -> np.ndarray:
        return self.writer.batch_put(encode_keys(keys), values, replicas)

    def put(self, key: str | bytes, value: bytes, replicas: int | None = None) -> Status:
        kb = encode_key(key)
        return _raise_put(kb, Status(int(self.writer.batch_put([kb], [value], replicas)[0])))

    # ------------------------------------------------------------------ gets
    def get_into(self, key: str | bytes, ptr: int, nbytes: int) -> int:
        """Copy the object into ``[ptr, ptr + nbytes)``; its size. ``KeyNotFound`` if absent."""
        ptr, nbytes = check_int(ptr, "ptr", 1), check_int(nbytes, "nbytes", 1)
        return self.session.read(self.reader.get_into, encode_key(key), ptr, nbytes)

    def get_into_layers(self, key: str | bytes, ptrs: Any, sizes: Any) -> int:
        P, S = u64(ptrs, "ptrs"), u64(sizes, "sizes", positive=True)
        return self.session.read(self.reader.get_into_layers, encode_key(key), P, S)

    def batch_get_into(self, keys: Keys, ptrs: Any, sizes: Any) -> np.ndarray:
        P, S = u64(ptrs, "ptrs")[:, None], u64(sizes, "sizes", positive=True)[:, None]
        return self.session.read(self.reader.batch_get_into_layers, encode_keys(keys), P, S)

    def batch_get_into_layers(self, keys: Keys, ptrs: Any, sizes: Any) -> np.ndarray:
        kb = encode_keys(keys)
        P = u64(ptrs, "ptrs").reshape(len(kb), -1)
        S = u64(sizes, "sizes", positive=True).reshape(np.shape(sizes))
        S = np.broadcast_to(S, P.shape) if S.ndim == 1 else S
        return self.session.read(self.reader.batch_get_into_layers, kb, P, S)

    def get(self, key: str | bytes) -> bytes:
        return self.session.read(self.reader.get, encode_key(key))

    def batch_get(self, keys: Keys) -> list[bytes | None]:
        return [self.session.read(self.reader.get_or_none, k) for k in encode_keys(keys)]

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Leave the fabric (the service then drops this rank's objects) and release
        the window and the table. Idempotent."""
        self.session.close()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _raise_put(key: bytes, st: Status) -> Status:
    if st in (Status.OK, Status.EXISTS):
        return st
    name = f"pool key '{key_text(key)}'"
    if st == Status.NO_SPACE:
        raise OutOfSpace(f"no space for {name}")
    if st == Status.LEASE_EXPIRED:
        raise LeaseExpired(f"write lease of {name} expired before commit")
    if st == Status.NOT_FOUND:
        raise KeyNotFound(name)
    raise TransferFailed(f"put of {name} failed: {st.name}")
