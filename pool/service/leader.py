"""``Campaign``: one meta service's bid for its pool's leadership, through etcd.

No consensus of our own: etcd decides. Meta services of one pool (one per node, each
started with ``leader_election``) run a campaign each:

1. grant an etcd lease of ``ttl`` seconds;
2. one transaction creates the leader key (``kvfabric/pool/<name>/leader``, holding this
   service's :class:`~kvfabric.pool.client.leader.LeaderRecord`) attached to that lease,
   only if the key does not exist. The one whose transaction succeeds leads;
3. the others stand by: they watch the key and go back to 1 when it is deleted (the
   leader's lease ended), or every ``ttl / 2`` to look again.

The leader keeps its lease alive every ``ttl / 3``. **It fails closed**: it may grant
(allocations, commits, anything that reads or changes the directory) only before a local
monotonic deadline, the last keep-alive's send time plus the TTL etcd granted then, minus
a margin (``margin_s``); :meth:`Campaign.may_grant` checks it on every request. etcd's own
countdown starts no earlier than that send, so the deadline always passes before etcd can
let another service win. A leader frozen (SIGSTOP) past its deadline grants nothing when it
wakes, before its keep-alive thread has even run; one that cannot reach etcd stops
granting at the deadline and steps down once its keep-alive finds the lease gone (or the
deadline passed with etcd still unreachable). Stepping down calls ``on_deposed`` and the
service stands by again.

Callbacks run on the campaign's thread: ``on_elected()`` before the state turns
``LEADER`` (the service resets its directory there; nothing is granted until it
returns), ``on_deposed(reason)`` after it turned ``STANDBY`` (nothing is granted any more
when it runs). ``stop()`` revokes a held lease so a standby takes over at once. The
campaign owns its etcd session (``store``) and closes it in ``stop()``.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvfabric.errors import ServiceUnavailable
from kvfabric.pool.client.leader import leader_key
from kvfabric.pool.gva.rendezvous.etcd import EtcdStore

log = logging.getLogger("kvfabric.pool.leader")


class LeaderState(enum.Enum):
    """Where a campaign stands."""

    STANDBY = "standby"  # not leading: campaigning or watching the leader key
    LEADER = "leader"  # holds the leader key under its lease (grants only before the deadline)
    STOPPED = "stopped"  # stop() was called


def margin_s(ttl: float) -> float:
    """How long before the lease's end (as this process reckons it) a leader stops granting:
    a fifth of the TTL, at least 0.2 s and at most 1 s."""
    return min(max(0.2 * ttl, 0.2), 1.0)


@dataclass(frozen=True)
class CampaignStatus:
    """A campaign as ``Info`` and ``/health`` show it: ``state``; ``leader`` (the leader
    key's record ``rpc``: this service's when it leads, '' when none is known); ``terms``
    (times elected); ``grant_s_left`` (seconds before the leader stops granting; 0 when not
    leading)."""

    state: LeaderState
    leader: str
    terms: int
    grant_s_left: float


class Campaign:
    """See module docstring. ``record``: the leader key's value for this service;
    ``clock``: monotonic seconds (injectable for tests)."""

    def __init__(
        self,
        store: EtcdStore,
        pool: str,
        record: bytes,
        ttl: int,
        on_elected: Callable[[], None],
        on_deposed: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1:
            raise ValueError(f"leader_ttl_s must be an int >= 1, got {ttl!r}")
        self.store = store
        self.pool = pool
        self.key = leader_key(pool)
        self.record = record
        self.ttl = ttl
        self.margin = margin_s(ttl)
        self.clock = clock
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self.state = LeaderState.STANDBY
        self.terms = 0
        self.leader = ""  # the leader's rpc address as last seen in the key
        self._lease = 0
        self._deadline = 0.0  # clock() before which this leader may grant
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the gate
    def may_grant(self) -> bool:
        """True only while leading with a lease this process knows to be live (see
        module docstring). Call before every grant."""
        return self.state is LeaderState.LEADER and self.clock() < self._deadline

    def status(self) -> CampaignStatus:
        left = max(0.0, self._deadline - self.clock()) if self.state is LeaderState.LEADER else 0.0
        return CampaignStatus(self.state, self.leader, self.terms, round(left, 3))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Campaign:
        if self._thread is not None:
            raise ValueError("Campaign.start called twice")
        self._thread = threading.Thread(target=self._run, name="kvfabric-pool-campaign", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop campaigning; a leader gives the key up at once (revokes its lease). Idempotent."""
        if self.state is LeaderState.STOPPED:
            return
        leading = self.state is LeaderState.LEADER
        self.state = LeaderState.STOPPED
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if leading and self._lease:
            try:
                self.store.revoke(self._lease)
            except ServiceUnavailable as e:
                log.warning("pool %r: could not give up the leadership at once: %s", self.pool, e)
        self.store.close()

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        retry = min(self.ttl / 10.0, 0.5)
        while not self._stop.is_set():
            try:
                if self.state is LeaderState.LEADER:
                    self._lead()
                else:
                    self._campaign()
            except ServiceUnavailable as e:
                log.debug("pool %r campaign: %s", self.pool, e)
                self._stop.wait(retry)
            except Exception:
                log.exception("pool %r campaign failed; trying again", self.pool)
                self._stop.wait(retry)

    def _campaign(self) -> None:
        """One round of standing: try to create the key; else watch it for a while."""
        sent = self.clock()
        lease = self.store.grant(self.ttl)
        try:
            won, kv, rev = self.store.create_if_absent(self.key, self.record, lease)
        except BaseException:
            self._revoke_quietly(lease)
            raise
        if won:
            self._lease, self._deadline = lease, sent + self.ttl - self.margin
            self.leader = self._own_rpc()
            try:
                self._on_elected()
            except BaseException:
                self._lease = 0
                self._revoke_quietly(lease)
                raise
            if self._stop.is_set() or self.clock() >= self._deadline:
                self._revoke_quietly(lease)
                return
            self.terms += 1
            self.state = LeaderState.LEADER
            log.warning("pool %r: this meta service leads now (term %d)", self.pool, self.terms)
            return
        self._revoke_quietly(lease)
        self.leader = self._rpc_of(kv.value) if kv is not None else ""
        if kv is None:
            return  # deleted between the two steps: campaign again now
        events, _ = self.store.watch_key(self.key, rev, self.ttl / 2.0)
        if any(e.value is None for e in events):
            self.leader = ""

    def _lead(self) -> None:
        """Keep the lease alive every ttl / 3; step down when it is gone."""
        period = self.ttl / 3.0
        retry = min(self.ttl / 10.0, 0.5)
        wait = period
        while not self._stop.wait(max(0.0, min(wait, self._deadline - self.clock()))):
            sent = self.clock()
            try:
                left = self.store.keepalive_once(self._lease)
            except ServiceUnavailable as e:
                if self.clock() >= self._deadline:
                    self._step_down(f"etcd unreachable past the lease's end: {e}")
                    return
                wait = retry
                continue
            if left <= 0:
                self._step_down("the etcd lease expired (this process was silent for its TTL)")
                return
            self._deadline, wait = sent + left - self.margin, period

    def _step_down(self, reason: str) -> None:
        if self.state is not LeaderState.LEADER:
            return
        self.state = LeaderState.STANDBY
        self.leader = ""
        self._lease = 0
        log.warning("pool %r: this meta service stepped down: %s", self.pool, reason)
        self._on_deposed(reason)

    def _revoke_quietly(self, lease: int) -> None:
        try:
            self.store.revoke(lease)
        except ServiceUnavailable:
            pass  # it expires by itself

    def _own_rpc(self) -> str:
        return self._rpc_of(self.record)

    @staticmethod
    def _rpc_of(value: bytes) -> str:
        from kvfabric.pool.client.leader import LeaderRecord

        try:
            return LeaderRecord.decode(value).rpc
        except Exception:  # noqa: BLE001 - a foreign value: no address
            return ""
