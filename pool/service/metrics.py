"""Prometheus metrics of one meta service (``kvfabric_pool_*``), on its own registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kvfabric.pool.status import Status
from kvfabric.status import succeeded

if TYPE_CHECKING:
    from kvfabric.pool.service.meta import MetaService


class _LocalReads(Collector):
    """The on-node reads the clients count in the directory table's header (reads served
    from this node's memory never reach the service as RPCs), as Prometheus counters."""

    HELP = {
        "local_keys": "keys asked of the directory table by on-node reads",
        "local_hits": "on-node reads served from this node's memory",
        "local_hit_bytes": "bytes moved by on-node reads",
        "local_corrupt": "on-node reads refused by the checksum check (served as misses)",
    }

    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def collect(self) -> Any:
        for name, text in self.HELP.items():
            yield CounterMetricFamily(f"kvfabric_pool_{name}", text, value=self.values.get(name, 0))


class _KvEvents(Collector):
    """The KV event publisher's counters (``service/events.py``); zeros while it is off.
    ``source``: the publisher's ``metrics`` (set by the node that starts one)."""

    HELP = {
        "kv_events_published": "block hashes announced as KV events (and clears)",
        "kv_event_batches": "KV event batches sent (the last sequence number is this minus one)",
        "kv_events_dropped": "KV events dropped because the publisher fell behind (a snapshot follows)",
        "kv_event_snapshots": "KV event snapshots sent (AllBlocksCleared and the whole directory)",
        "kv_event_replays": "KV event replay requests served",
    }
    FROM = {
        "kv_events_published": "published",
        "kv_event_batches": "batches",
        "kv_events_dropped": "dropped",
        "kv_event_snapshots": "snapshots",
        "kv_event_replays": "replays",
    }

    def __init__(self) -> None:
        self.source: Callable[[], dict[str, int]] | None = None

    def collect(self) -> Any:
        values = self.source() if self.source is not None else {}
        for name, text in self.HELP.items():
            yield CounterMetricFamily(f"kvfabric_pool_{name}", text, value=values.get(self.FROM[name], 0))


class PoolMetrics:
    """Requests, failures, latency per operation; objects, bytes, evictions per window."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvfabric_pool_requests", "RPC requests by operation", ["op"], registry=r)
        self.keys = Counter("kvfabric_pool_keys", "keys named by requests, by operation", ["op"], registry=r)
        self.failures = Counter(
            "kvfabric_pool_key_failures",
            "keys whose status was not OK, by operation and status",
            ["op", "status"],
            registry=r,
        )
        self.errors = Counter(
            "kvfabric_pool_request_errors", "requests refused as a whole", ["op"], registry=r
        )
        self.latency = Histogram(
            "kvfabric_pool_request_seconds",
            "service time per request",
            ["op"],
            buckets=(5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2, 0.1, 1.0),
            registry=r,
        )
        self.objects = Gauge("kvfabric_pool_objects", "objects in the directory", registry=r)
        self.used = Gauge("kvfabric_pool_used_bytes", "allocated bytes", ["rank", "medium"], registry=r)
        self.capacity = Gauge("kvfabric_pool_capacity_bytes", "window bytes", ["rank", "medium"], registry=r)
        self.evictions = Gauge("kvfabric_pool_evicted_objects", "objects evicted so far", registry=r)
        self.evicted_bytes = Gauge("kvfabric_pool_evicted_bytes", "bytes evicted so far", registry=r)
        self.fenced = Gauge(
            "kvfabric_pool_fenced_bytes",
            "space of writes that outlived their lease, reserved until the writer is done or gone",
            ["rank", "medium"],
            registry=r,
        )
        self.fences = Gauge("kvfabric_pool_fences", "write leases that expired before the commit", registry=r)
        self.replica_extents = Gauge(
            "kvfabric_pool_replica_extents", "extents holding a second or later copy of an object", registry=r
        )
        self.under_replicated = Gauge(
            "kvfabric_pool_under_replicated",
            "puts placed on fewer ranks than their replicas asked",
            registry=r,
        )
        self.promoted = Gauge(
            "kvfabric_pool_promoted",
            "objects whose first extent left with its rank and a copy took over",
            registry=r,
        )
        self.replicas_lost = Gauge(
            "kvfabric_pool_replicas_lost",
            "copies gone with their rank from objects that stayed readable",
            registry=r,
        )
        self._children: dict[str, tuple[Any, Any, Any]] = {}
        self.local = _LocalReads()
        r.register(self.local)
        self.kv_events = _KvEvents()
        r.register(self.kv_events)

    def observe(self, op: str, seconds: float, reply: Any) -> None:
        children = self._children.get(op)
        if children is None:  # labelled children are looked up once per operation
            children = self._children[op] = (
                self.requests.labels(op),
                self.latency.labels(op),
                self.keys.labels(op),
            )
        requests, latency, keys = children
        requests.inc()
        latency.observe(seconds)
        if reply.error:
            self.errors.labels(op).inc()
        n = max(len(reply.status), len(reply.flags))
        if n:
            keys.inc(n)
        for code in reply.status:
            if not succeeded(code):
                self.failures.labels(op, Status(code).name).inc()

    def update_state(self, service: MetaService) -> None:
        replica_slots = service.replica_slots()
        self.objects.set(service.table.count - replica_slots)  # as Info counts them
        self.replica_extents.set(replica_slots)
        self.under_replicated.set(service.counters.under_replicated)
        self.promoted.set(service.counters.promoted)
        self.replicas_lost.set(service.counters.replicas_lost)
        for row in service.capacity():
            labels = (str(row["rank"]), str(row["medium"]))
            self.used.labels(*labels).set(row["used"])
            self.capacity.labels(*labels).set(row["capacity"])
            self.fenced.labels(*labels).set(row["fenced"])
        self.fences.set(service.counters.fences)
        self.evictions.set(service.counters.evicted_objects)
        self.evicted_bytes.set(service.counters.evicted_bytes)
        self.local.values = service.table.view.local_reads()

    def render(self) -> bytes:
        return generate_latest(self.registry)
