"""The discrete-event replay of a trace over a simulated cluster, and its :class:`Report`.

Contract: :func:`simulate` consumes the trace once, in arrival order, keeping only the
cluster's state, the requests waiting at engines and one float per request (its TTFT),
and returns a :class:`Report`. The same inputs give the same report.

Events, in simulated time (ties: arrivals first, then in the order they were scheduled):

* **arrival**: the router picks an engine (``routing.py``); the request joins that
  engine's FIFO queue; an idle engine schedules its next start.
* **start** (the engine takes the head of its queue): the lookup walks the request's
  full blocks in order, never the block holding the last prompt token (as the connector
  never claims it), taking each from the engine's HBM, else the node's DRAM, else its
  SSD, and stops at the first block no tier holds (blocks are chained: a later one is no
  use without it). Hits mark their block most recently used in the tier that served it.
  The engine is then busy for the load (bytes per tier over that tier's bandwidth, a
  fixed cost per loaded block and per loading request, one pool lookup) and the prefill
  of the tokens not loaded (:meth:`~kvfabric.simulate.config.Calibration.prefill_s`).
* **first token**: TTFT is now minus the arrival. The prompt's full blocks are stored:
  all of them into the engine's HBM; those it computed into the node's DRAM and SSD (the
  connector's write-through; put-if-absent), and with ``promote`` the SSD hits into
  DRAM. The engine then owes the request's decode (output tokens over the engine's decode
  throughput: decode shares the engine with later prefills as work, not as a batch
  schedule) and starts its next request after that.
"""

from __future__ import annotations

import gc
import heapq
import math
import resource
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvfabric.simulate.config import Calibration, ClusterConfig, Routing, TierName
from kvfabric.simulate.routing import make_router
from kvfabric.simulate.tiers import KvIndex, Node
from kvfabric.simulate.trace import Request

_START, _DONE = 0, 1
_NONE: dict[Any, int] = {}  # the objects of a tier a node does not have (never written)
GiB = float(1 << 30)


@dataclass(frozen=True)
class Report:
    """What one replay found (per tier: ``hbm``, ``dram``, ``ssd``)."""

    requests: int
    lookup_blocks: int  #: full blocks the lookups could hit (the hit rate's denominator)
    hit_blocks: dict[str, int]
    hit_rate: float  #: hit blocks over lookup blocks, all tiers
    hit_rate_by_tier: dict[str, float]
    token_hit_rate: float  #: prompt tokens loaded over prompt tokens
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    makespan_s: float  #: first arrival to last decode end, simulated
    requests_per_s: float
    tokens_per_s: float  #: prompt and output tokens over the makespan
    engine_busy: float  #: busy time over engines x makespan
    bytes_loaded: dict[str, int]
    bytes_stored: dict[str, int]
    evictions: dict[str, int]
    refused: dict[str, int]  #: stores that found no room even after eviction
    cost_per_mtok: float | None  #: price of the cluster over the makespan per 10^6 tokens
    wall_s: float
    peak_rss_mib: float

    def as_row(self) -> dict[str, Any]:
        """A flat mapping for ``--json`` (per-tier figures as ``<figure>_<tier>``)."""
        out: dict[str, Any] = {}
        for k, v in asdict(self).items():
            if isinstance(v, dict):
                out.update({f"{k}_{t}": x for t, x in v.items()})
            else:
                out[k] = v
        return out


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if x.size else math.nan


def simulate(
    cluster: ClusterConfig,
    cal: Calibration,
    requests: Iterable[Request],
    progress: Callable[[int], None] | None = None,
    on_first_token: Callable[[Request, float, int, int], None] | None = None,
) -> Report:
    """Replay ``requests`` over ``cluster`` timed by ``cal`` (module docstring).
    ``progress(n)`` is called every 4,096 requests with how many have arrived;
    ``on_first_token(request, ttft_s, hit_blocks, claimable_blocks)`` once per request."""
    t_wall = time.perf_counter()
    gc_was = gc.isenabled()
    gc.disable()  # millions of long-lived records and no cycles: collections only cost time
    try:
        return _simulate(cluster, cal, requests, progress, on_first_token, t_wall)
    finally:
        if gc_was:
            gc.enable()


def _simulate(
    cluster: ClusterConfig,
    cal: Calibration,
    requests: Iterable[Request],
    progress: Callable[[int], None] | None,
    on_first_token: Callable[[Request, float, int, int], None] | None,
    t_wall: float,
) -> Report:
    per = cluster.engines_per_node
    n_eng = cluster.engines
    index = KvIndex() if cluster.routing is Routing.PREFIX_AWARE else None
    nodes = [Node(i, cluster, index) for i in range(cluster.nodes)]
    router = make_router(cluster, index)
    bt = cluster.block_tokens
    bb = cluster.block_bytes
    promote = cluster.promote
    has_pool = cluster.dram_bytes > 0 or cluster.ssd_bytes > 0
    dram_s = bb / (cal.dram_load_gbps * 1e9)
    ssd_s = bb / (cal.ssd_load_gbps * 1e9)
    hbm_s = bb / (cal.hbm_load_gbps * 1e9) if cal.hbm_load_gbps > 0 else 0.0
    blk_s = cal.load_block_s
    fixed_s = cal.load_fixed_s
    rpc_s = cal.lookup_rpc_s if has_pool else 0.0
    decode_tps = cal.decode_tokens_per_s

    load = [0] * n_eng
    queues: list[deque[Request]] = [deque() for _ in range(n_eng)]
    running = [False] * n_eng
    free_at = [0.0] * n_eng
    busy = 0.0
    ttfts = array("d")
    heap: list[tuple[float, int, int, int, Any]] = []
    seq = 0
    hits = {TierName.HBM: 0, TierName.DRAM: 0, TierName.SSD: 0}
    lookup_blocks = 0
    prompt_tokens = 0
    cached_tokens_total = 0
    tokens = 0
    first_arrival = math.nan
    last_end = 0.0
    last_arrival = -math.inf
    arrived = 0

    it = iter(requests)
    nxt = next(it, None)
    while nxt is not None or heap:
        if nxt is not None and (not heap or nxt.arrival_s <= heap[0][0]):
            req, now = nxt, nxt.arrival_s
            if now < last_arrival:
                raise ValueError(
                    f"trace out of order: a request arrives at {now} s after one at {last_arrival} s"
                )
            last_arrival = now
            if arrived == 0:
                first_arrival = now
            arrived += 1
            if progress is not None and not arrived & 4095:
                progress(arrived)
            nxt = next(it, None)
            claim = min(len(req.keys), max(req.prompt_tokens - 1, 0) // bt)
            e = router.route(req.keys[:claim] if claim < len(req.keys) else req.keys, load)
            load[e] += 1
            queues[e].append(req)
            if not running[e]:
                running[e] = True
                heapq.heappush(heap, (max(now, free_at[e]), seq, _START, e, None))
                seq += 1
            continue
        now, _, kind, e, payload = heapq.heappop(heap)
        node = nodes[e // per]
        hbm = node.hbm[e % per]
        dram, ssd = node.dram, node.ssd
        if kind == _START:
            req = queues[e].popleft()
            claim = min(len(req.keys), max(req.prompt_tokens - 1, 0) // bt)
            h = d = s = 0
            from_ssd = []
            # Tier.hit inlined (the hot loop): pop and put back = most recently used
            ho = _NONE if hbm is None else hbm.objects
            do = _NONE if dram is None else dram.objects
            so = _NONE if ssd is None else ssd.objects
            for k in req.keys[:claim]:
                off = ho.pop(k, None)
                if off is not None:
                    ho[k] = off
                    h += 1
                    continue
                off = do.pop(k, None)
                if off is not None:
                    do[k] = off
                    d += 1
                    continue
                off = so.pop(k, None)
                if off is not None:
                    so[k] = off
                    s += 1
                    from_ssd.append(k)
                    continue
                break
            cached = (h + d + s) * bt
            lookup_blocks += claim
            hits[TierName.HBM] += h
            hits[TierName.DRAM] += d
            hits[TierName.SSD] += s
            service = (
                (rpc_s if claim else 0.0)
                + h * hbm_s
                + d * dram_s
                + s * ssd_s
                + (d + s) * blk_s
                + (fixed_s if d + s else 0.0)
                + cal.prefill_s(req.prompt_tokens - cached, cached)
            )
            busy += service
            heapq.heappush(heap, (now + service, seq, _DONE, e, (req, h + d + s, claim, from_ssd)))
            seq += 1
            continue
        req, n_hit, claim, from_ssd = payload
        ttfts.append(now - req.arrival_s)
        if on_first_token is not None:
            on_first_token(req, now - req.arrival_s, n_hit, claim)
        stored = min(len(req.keys), req.prompt_tokens // bt)
        keys = req.keys
        if hbm is not None:  # the hits were marked at the start; the rest are new here
            ho, put = hbm.objects, hbm.insert
            for k in keys[:stored]:
                if k not in ho:
                    put(k, now)
        computed = keys[n_hit:stored]
        for tier in (dram, ssd):
            if tier is not None:
                put = tier.insert
                for k in computed:
                    put(k, now)
        if promote and dram is not None:
            for k in from_ssd:
                dram.insert(k, now)
        if index is not None:  # only computed blocks are new to the node
            stored_at = index.stored
            nid = node.node
            for k in computed:
                stored_at(k, nid)
        prompt_tokens += req.prompt_tokens
        cached_tokens_total += n_hit * bt
        tokens += req.prompt_tokens + req.output_tokens
        decode = req.output_tokens / decode_tps
        busy += decode
        free_at[e] = now + decode
        last_end = max(last_end, free_at[e])
        load[e] -= 1
        if queues[e]:
            heapq.heappush(heap, (free_at[e], seq, _START, e, None))
            seq += 1
        else:
            running[e] = False
    if progress is not None:
        progress(arrived)

    tiers = [t for n in nodes for t in n.tiers]
    names = [t.value for t in TierName]

    def per_tier(fn: Callable[[Any], int]) -> dict[str, int]:
        out = dict.fromkeys(names, 0)
        for t in tiers:
            out[t.tier.value] += fn(t)
        return out

    x = np.frombuffer(ttfts, np.float64) if len(ttfts) else np.zeros(0)
    span = (last_end - first_arrival) if arrived else 0.0
    total_hits = sum(hits.values())
    cost = None
    p = cluster.price
    hourly = cluster.nodes * (
        p.node_hour + p.dram_gib_hour * cluster.dram_bytes / GiB + p.ssd_gib_hour * cluster.ssd_bytes / GiB
    )
    if hourly > 0 and tokens:
        cost = hourly * span / 3600 / (tokens / 1e6)
    return Report(
        requests=arrived,
        lookup_blocks=lookup_blocks,
        hit_blocks={t.value: n for t, n in hits.items()},
        hit_rate=total_hits / lookup_blocks if lookup_blocks else 0.0,
        hit_rate_by_tier={t.value: (n / lookup_blocks if lookup_blocks else 0.0) for t, n in hits.items()},
        token_hit_rate=cached_tokens_total / prompt_tokens if prompt_tokens else 0.0,
        ttft_p50_s=_pct(x, 50),
        ttft_p99_s=_pct(x, 99),
        ttft_mean_s=float(x.mean()) if x.size else math.nan,
        makespan_s=span,
        requests_per_s=arrived / span if span > 0 else 0.0,
        tokens_per_s=tokens / span if span > 0 else 0.0,
        engine_busy=busy / (n_eng * span) if span > 0 else 0.0,
        bytes_loaded={
            TierName.HBM.value: hits[TierName.HBM] * bb,
            TierName.DRAM.value: hits[TierName.DRAM] * bb,
            TierName.SSD.value: hits[TierName.SSD] * bb,
        },
        bytes_stored=per_tier(lambda t: t.stored * bb),
        evictions=per_tier(lambda t: t.evicted),
        refused=per_tier(lambda t: t.refused),
        cost_per_mtok=cost,
        wall_s=time.perf_counter() - t_wall,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )


__all__ = ["Report", "simulate"]
