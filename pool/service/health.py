"""What the daemon's ``/health`` answers: is this pool node fit to take traffic?

A load balancer or an orchestrator's readiness probe asks ``/health``; it gets 200 with
``{"ready": true, ...}`` when every check passes and 503 with ``{"ready": false,
"failing": {check: reason}}`` otherwise. Every answer carries ``role`` (:class:`Role`):
``leader`` or ``standby`` with ``leader_election``, ``single`` without, and, with
election, ``leader`` (the leader's RPC address as this service last saw it, '' when none
is known) and ``terms``. The checks (:class:`Check`):

``table``       the directory table is published: the node finished starting and the
                table clients map carries the service's epoch (a restart that has not
                re-published it, or a retired table, fails);
``fabric``      the node's rank 0 is a joined member of its GVA fabric;
``rendezvous``  the rendezvous store (the node's own server or etcd) answers a read
                within ``RENDEZVOUS_TIMEOUT_S`` and the fabric's session is not lost;
``space``       the latest allocation that fits a window was not refused for space
                (eviction could not make room: the windows are held by write leases,
                read leases or fences, or the directory is full of such objects) — once
                an allocation succeeds again the check passes;
``leader``      with ``leader_election`` only: this meta service leads and may grant
                (the dispatcher's gate lets requests through). A standby answers every
                data request ``NOT_LEADER``, so it is not ready: a load balancer sends it
                nothing, and a client finds the leader through etcd. A standby that passes
                every other check is fit to take over: ``/health?standby=ok`` (for a
                liveness probe) answers it 200, still ``ready: false``.

:func:`check_health` reads the node; the table, fabric and space checks take the
dispatcher's lock for a moment (no RPC waits behind a probe longer than a dictionary
read), the rendezvous read runs outside it.
"""

from __future__ import annotations

import enum
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfabric.pool.service.node import PoolNode

RENDEZVOUS_TIMEOUT_S = 1.0


class Check(enum.Enum):
    TABLE = "table"
    FABRIC = "fabric"
    RENDEZVOUS = "rendezvous"
    SPACE = "space"
    LEADER = "leader"


class Role(enum.Enum):
    """What the meta service is in its pool."""

    SINGLE = "single"  # no leader election: the only meta service of its pool
    LEADER = "leader"
    STANDBY = "standby"  # campaigning or watching the leader key (or stopped)


@dataclass(frozen=True)
class Health:
    """One probe's outcome: ``failing`` maps each failed check to why (empty: ready)."""

    failing: dict[Check, str] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    role: Role = Role.SINGLE

    @property
    def ready(self) -> bool:
        return not self.failing

    @property
    def fit_to_take_over(self) -> bool:
        """A standby whose only failing check is the leadership (``?standby=ok``)."""
        return self.role is Role.STANDBY and set(self.failing) == {Check.LEADER}

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ready": self.ready, "role": self.role.value, **self.details}
        if self.failing:
            out["failing"] = {c.value: why for c, why in self.failing.items()}
        return out


def _table(node: PoolNode) -> str | None:
    if not node.serving:
        return "the node has not finished starting (or is stopping)"
    try:
        published, retired = node.table.epoch, node.table.retired
    except Exception as e:  # noqa: BLE001 - a closed or unmapped table: reported
        return f"the directory table cannot be read: {type(e).__name__}: {e}"
    if retired:
        return "the directory table is retired (a restarted service replaced it)"
    if published != node.dispatcher.epoch:
        return f"the directory table carries epoch {published}, the service {node.dispatcher.epoch}"
    return None


def _fabric(node: PoolNode) -> str | None:
    from kvfabric.pool.gva.fabric import FabricState

    fab = getattr(node, "fabric", None)
    if fab is None:
        return "the node has no fabric rank"
    if fab.state is not FabricState.JOINED:
        return f"the node's fabric rank is {fab.state.value}, not joined"
    return None


_probes: weakref.WeakKeyDictionary[Any, threading.Thread] = weakref.WeakKeyDictionary()
_probes_lock = threading.Lock()


def _rendezvous(node: PoolNode) -> str | None:
    fab = getattr(node, "fabric", None)
    store = getattr(fab, "store", None)
    if store is None:
        return "no rendezvous store"
    if store.session_lost:
        return "the fabric's rendezvous session is lost"
    errors: list[BaseException] = []

    def read() -> None:
        try:
            store.try_get("kvfabric/health")  # any read: absent is fine, silence is not
        except BaseException as e:  # noqa: BLE001 - reported by the probe
            errors.append(e)

    with _probes_lock:  # one read in flight per store: probes never pile up behind a hung one
        previous = _probes.get(store)
        if previous is not None and previous.is_alive():
            return "the rendezvous store has not answered an earlier read yet"
        t = threading.Thread(target=read, name="kvfabric-health-probe", daemon=True)
        _probes[store] = t
        t.start()
    t.join(RENDEZVOUS_TIMEOUT_S)
    if t.is_alive():
        return f"the rendezvous store did not answer a read within {RENDEZVOUS_TIMEOUT_S:g} s"
    if errors:
        return f"the rendezvous store did not answer a read: {type(errors[0]).__name__}: {errors[0]}"
    return None


def _space(node: PoolNode) -> str | None:
    refused = node.service.space_refused_at
    if refused is None:
        return None
    ago = node.service.clock() - refused
    return f"the latest allocation was refused for space {ago:.1f} s ago (nothing evictable)"


def _leader(node: PoolNode) -> tuple[Role, str | None, dict[str, Any]]:
    """The role, why this service may not grant (None: it may), and what it knows."""
    from kvfabric.pool.service.leader import LeaderState

    campaign = getattr(node, "campaign", None)
    if campaign is None:
        return Role.SINGLE, None, {}
    st = campaign.status()
    role = Role.LEADER if st.state is LeaderState.LEADER else Role.STANDBY
    known = {"leader": st.leader, "terms": st.terms}
    gate = node.dispatcher.gate
    why = gate() if gate is not None else None
    if role is Role.STANDBY and why is None:
        why = f"this meta service is {st.state.value}"
    return role, why, known


def check_health(node: PoolNode) -> Health:
    """Run every check on ``node`` (see module docstring)."""
    failing: dict[Check, str] = {}
    with node.dispatcher.lock:
        for check, fn in ((Check.TABLE, _table), (Check.FABRIC, _fabric), (Check.SPACE, _space)):
            why = fn(node)
            if why:
                failing[check] = why
        role, why, known = _leader(node)
        if why:
            failing[Check.LEADER] = why
        info = node.dispatcher.info()
    why = _rendezvous(node)
    if why:
        failing[Check.RENDEZVOUS] = why
    details = {k: info[k] for k in ("epoch", "objects", "ranks", "capacity") if k in info}
    return Health(failing, {**details, **known}, role)
