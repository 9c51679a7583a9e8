"""Finding a pool's leader through etcd, and a transport that follows it.

Where the meta service's leadership is elected (``PoolConfig.leader_election``,
``kvfabric.pool.service.leader``), the leader holds one etcd key,
``kvfabric/pool/<name>/leader``, attached to its lease; its value is a
:class:`LeaderRecord` (msgpack) carrying the TCP address of its RPC listener. The key
vanishes when the leader's lease ends (it died, froze, or lost etcd), and the next leader
creates it again.

:class:`LeaderTransport` is a client transport (``Transport`` of ``rpc.py``) over that key:
it reads the key, calls the leader over TCP with the token, and when the leader does not
answer, refuses as ``NOT_LEADER`` or is not known yet, reads the key again and retries,
for at most ``retry_s`` seconds a call: every attempt is bounded by the time left and every
read of the key by ``RESOLVE_S``, so no call blocks longer than ``retry_s`` (1.5 s by
default; 2 s is the pool's promise). It never resends a request that
may have been applied (sent, no reply) to the same leader unless the request is
idempotent (:data:`IDEMPOTENT`: reads, renewals, re-registrations); others go again only to
a different leader, which cannot have seen them. Out of time it raises
``ServiceUnavailable`` naming the pool and the last leader it tried. Thread-safe: one
connection to the current leader, calls serialised on it; the etcd session is the
transport's own (closed with it).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import msgspec

from kvfabric.errors import ServiceUnavailable
from kvfabric.pool import protocol as p
from kvfabric.pool.client.rpc import SentUnanswered, SocketTransport, TokenRefused, checked

log = logging.getLogger("kvfabric.pool.client")

#: requests that may be sent again after one whose reply never came
IDEMPOTENT = (p.Info, p.Hello, p.Lookup, p.Exists, p.ListKeys, p.Renew, p.Reregister, p.Release)
RETRY_S = 1.5  # how long one call keeps looking for a leader
POLL_S = 0.05  # between two reads of the leader key while there is none
RESOLVE_S = 0.3  # the longest one read of the leader key may take
MIN_ATTEMPT_S = 0.05  # no attempt is started with less time left than this


def leader_key(pool: str) -> str:
    """The etcd key the leader of pool ``pool`` holds."""
    return f"kvfabric/pool/{pool}/leader"


class LeaderRecord(msgspec.Struct, frozen=True):
    """The leader key's value: ``rpc`` (HOST:PORT of its TCP RPC listener), ``pid`` and
    ``node`` of the daemon, ``since`` (wall-clock seconds when it was elected)."""

    rpc: str
    pid: int
    node: str
    since: float

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(data: bytes) -> LeaderRecord:
        return msgspec.msgpack.decode(data, type=LeaderRecord)


def read_leader(store: Any, pool: str) -> LeaderRecord | None:
    """The leader of ``pool`` as the key says now (None: no leader); ``store`` an
    ``EtcdStore``. ``ServiceUnavailable`` when etcd does not answer."""
    kv = store.try_get(leader_key(pool))
    if kv is None:
        return None
    try:
        return LeaderRecord.decode(kv.value)
    except msgspec.DecodeError:
        log.warning("the leader key of pool %r holds something else: %r", pool, kv.value[:64])
        return None


class LeaderTransport:
    """See module docstring. ``etcd``: the url (``etcd://HOST:PORT``) where the leader is
    elected; ``auth``: its TLS / auth settings (``rendezvous.etcd.EtcdAuth``); ``token``:
    the pool's shared secret; ``timeout``: the longest one attempt waits for a reply."""

    remote = True

    def __init__(
        self,
        etcd: str,
        pool: str,
        *,
        token: str = "",
        auth: Any = None,
        timeout: float = 1.0,
        retry_s: float = RETRY_S,
    ) -> None:
        from kvfabric.pool.gva.rendezvous.etcd import EtcdStore

        if not 0 < retry_s <= 60:
            raise ValueError(f"retry_s must be in (0, 60] seconds, got {retry_s!r}")
        self.pool = pool
        self.token = token
        self.timeout = float(timeout)
        self.retry_s = float(retry_s)
        self.endpoint = f"{etcd} (leader of pool {pool!r})"
        # a read of the key must fit in a call's retry time, or a slow etcd would stretch it
        self._store = EtcdStore(etcd, call_timeout=min(self.timeout, RESOLVE_S), auth=auth)
        self._lock = threading.Lock()
        self._rpc: SocketTransport | None = None
        self._addr = ""
        self.changes = 0  # how many times the leader's address changed under this transport

    @property
    def leader(self) -> str:
        """HOST:PORT of the leader this transport calls now ('' when none is known)."""
        return self._addr

    def _resolve(self) -> SocketTransport | None:
        """The transport to the leader the key names now, reusing the open one."""
        try:
            rec = read_leader(self._store, self.pool)
        except ServiceUnavailable as e:
            log.debug("reading the leader of pool %r: %s", self.pool, e)
            return self._rpc
        if rec is None:
            return None
        if self._rpc is None or rec.rpc != self._addr:
            if self._rpc is not None:
                self._rpc.close()
                self.changes += 1
                log.info("pool %r: leader now at %s (was %s)", self.pool, rec.rpc, self._addr)
            self._rpc = SocketTransport(f"tcp://{rec.rpc}", timeout=self.timeout, token=self.token)
            self._addr = rec.rpc
        return self._rpc

    def _drop(self) -> None:
        if self._rpc is not None:
            self._rpc.close()

    def call(self, req: Any) -> p.Reply:
        with self._lock:
            return checked(self._call(req))

    def _call(self, req: Any) -> p.Reply:
        deadline = time.monotonic() + self.retry_s
        unanswered_at = ""  # a leader that may have applied ``req`` (sent, no reply)
        last = "no leader in etcd"
        rpc = self._rpc or self._resolve()
        while True:
            left = deadline - time.monotonic()
            resend = not (unanswered_at == self._addr and not isinstance(req, IDEMPOTENT))
            if rpc is not None and resend and left >= MIN_ATTEMPT_S:
                try:
                    reply = rpc.call_unchecked(req, timeout=min(self.timeout, left))
                except TokenRefused:
                    raise
                except SentUnanswered as e:
                    unanswered_at, last = self._addr, str(e)
                    self._drop()
                except ServiceUnavailable as e:
                    last = str(e)
                    self._drop()
                else:
                    if not reply.error.startswith(p.NOT_LEADER):
                        return reply
                    last = f"{self._addr}: {reply.error}"
            left = deadline - time.monotonic()
            if left < MIN_ATTEMPT_S + RESOLVE_S:
                raise ServiceUnavailable(
                    f"pool {self.pool!r}: no leader answered within {self.retry_s} s (last: {last})"
                )
            time.sleep(POLL_S)
            rpc = self._resolve()

    def close(self) -> None:
        with self._lock:
            self._drop()
            self._rpc = None
        self._store.close()
