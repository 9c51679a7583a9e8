"""``kvfabric bench pool``: the object pool next to memcpy, Mooncake Store and Redis.

Every case (object size x batch x client processes x put/get; see
:func:`kvfabric.bench.poolcase.build_cases`) runs against each store in the same run:

1. Mooncake Store (:mod:`~kvfabric.bench.stores.mooncake_host`, in a loopback-only
   network namespace; its clients contribute no memory, a store process owns it), and
   its embedded shape for the single-client cases;
2. Redis (``redis-server`` on 127.0.0.1, SET/GET, a pipeline per batch);
3. the kvfabric pool (a ``kvfabric pool serve`` daemon owns the memory; client
   processes put and get with the zero-copy calls).

Each store's cases run in client processes of their own (:class:`~kvfabric.bench.
poolrunner.Runner`), every round next to a memcpy of the same bytes in the same
processes, over working sets far larger than the CPU caches, with every buffer
pre-touched; figures are medians of rounds. A row per case carries the pool's figures,
``ratio_vs_memcpy``, ``ratio_vs_mooncake``, ``ratio_vs_redis`` (throughput ratios; for
``batch_exists``, call-time ratios), for reads ``ratio_verify_on_vs_off`` (the same case
measured again right after with checksum verification off, its figures in
``verify_off``), each peer's own figures in a nested object, and the machine load during
the pool's measurement (``other_core``). A peer that is not installed or does not start
leaves its ratio ``null`` and says why in its object. The
last row is the directory's size per object at 10^6 objects (:mod:`~kvfabric.bench.pooldir`).

Options (``BenchContext.options``, for tests and experiments): ``working_set``, ``sizes``
(bytes; 0 means the 122-piece block; a list of piece sizes is a layered object),
``batches``, ``clients``, ``peers``, ``round_s``, ``directory_objects``,
``directory_fill``, ``mooncake_embedded``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from kvfabric.bench import pooldir
from kvfabric.bench.poolcase import (
    BLOCK,
    Case,
    GiB,
    KiB,
    MiB,
    Op,
    Plan,
    Shape,
    build_cases,
    case_from_dict,
    case_to_dict,
)
from kvfabric.bench.poolrunner import CaseResult, Runner
from kvfabric.bench.report import BenchContext, machine_note
from kvfabric.bench.stores import module

MOONCAKE_TIMEOUT_S = 1800.0

Results = dict[tuple[Any, ...], CaseResult]


def make_plan(ctx: BenchContext) -> Plan:
    o = ctx.options
    quick = ctx.quick
    sizes = [_shape(s) for s in o.get("sizes", [64 * KiB, MiB, 4 * MiB, 0])]
    cases = build_cases(
        sizes,
        list(o.get("batches", [1, 32])),
        list(o.get("clients", [1, 4])),
        big_batch_max=1 if quick else None,
    )
    return Plan(
        working_set=int(o.get("working_set", 256 * MiB if quick else GiB)),
        rounds=max(ctx.rounds, 5),
        round_s=float(o.get("round_s", 0.05 if quick else 0.25)),
        cases=cases,
        directory_objects=int(o.get("directory_objects", 1_000_000)),
        directory_fill=int(o.get("directory_fill", 100_000 if quick else 1_000_000)),
        peers=tuple(o.get("peers", ("mooncake", "redis"))),
        mooncake_embedded=bool(o.get("mooncake_embedded", not quick)),
    )


def _shape(spec: int | list[int]) -> Shape:
    """An option's object: bytes, 0 for the 122-piece block, or a list of piece sizes."""
    if isinstance(spec, (list, tuple)):
        return Shape(f"block{len(spec)}", tuple(int(x) for x in spec))
    return BLOCK if int(spec) == 0 else Shape.plain(int(spec))


def run_store(store: str, plan: Plan, workdir: str, options: dict[str, Any] | None = None) -> Results:
    """Start ``store``, measure every case with its clients, stop it."""
    svc = module(store).start(plan.store_capacity(), workdir, options or {})
    try:
        runner = Runner(store, svc.params, plan.client_capacities())
        try:
            runner.warm(plan.working_set)
            return {c.key: runner.run(c, plan) for c in plan.cases}
        finally:
            runner.close()
    finally:
        svc.stop()


def run_mooncake(plan: Plan, workdir: str) -> tuple[Results, Results, str]:
    """(remote results, embedded results, error) of the Mooncake part."""
    request = {
        "working_set": plan.working_set,
        "rounds": plan.rounds,
        "round_s": plan.round_s,
        "cases": [case_to_dict(c) for c in plan.cases],
        "embedded": plan.mooncake_embedded,
    }
    remote: Results = {}
    embedded: Results = {}
    error = ""
    from kvfabric.bench.stores import mooncake_host

    log = os.path.join(workdir, "mooncake.log")
    for line in mooncake_host.run(request, log, MOONCAKE_TIMEOUT_S):
        if "result" in line:
            case = case_from_dict(line["case"])
            result = CaseResult.from_dict(line["result"])
            (remote if line["shape"] == "remote" else embedded)[case.key] = result
        else:
            error = str(line.get("message", line))
    failed = any(v.note.startswith("failed") for r in (remote, embedded) for v in r.values())
    if (error or failed) and os.path.exists(log):  # keep Mooncake's own log past the run
        kept = os.path.join(tempfile.gettempdir(), f"kvfabric-bench-pool-mooncake-{os.getpid()}.log")
        shutil.copyfile(log, kept)
        error = error and f"{error} (Mooncake's log: {kept})"
        for results in (remote, embedded):
            for key, res in results.items():
                if res.note.startswith("failed"):
                    results[key] = dataclasses.replace(res, note=f"{res.note} (Mooncake's log: {kept})")
    return remote, embedded, error


def _peer_fields(ours: CaseResult, peer: CaseResult | None, status: str, case: Case) -> tuple[Any, dict]:
    """(ratio of ours to the peer, the peer's nested object)."""
    if peer is None or not peer.ok:
        why = status or (peer.note if peer is not None else "") or "not measured"
        return None, {"status": why}
    info = {
        "gbps": peer.gbps,
        "p50_us": peer.p50_us,
        "p99_us": peer.p99_us,
        "vs_memcpy": _ratio(peer.gbps, peer.memcpy_gbps),
        "other_core": peer.cpu.get("other_core"),
        "status": "ok",
    }
    if case.op is Op.EXISTS:
        return _ratio(peer.p50_us, ours.p50_us), info
    return _ratio(ours.gbps, peer.gbps), info


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def make_row(
    case: Case, ours: CaseResult, peers: dict[str, tuple[Results, str]], note: dict[str, Any]
) -> dict[str, Any]:
    """One case's line: the figures and ratios at the top (the table shows those), the
    peers' own figures, memcpy's and the machine's in nested objects."""
    row: dict[str, Any] = {
        "case": case.label,
        "op": case.api,
        "nbytes": case.shape.nbytes if case.op is not Op.EXISTS else 0,
        "batch": case.batch,
        "clients": case.clients,
        "condition": case.condition,
        "gbps": ours.gbps,
        "p50_us": ours.p50_us,
        "p99_us": ours.p99_us,
        "ratio_vs_memcpy": _ratio(ours.gbps, ours.memcpy_gbps),
    }
    nested: dict[str, Any] = {}
    for name, (results, status) in peers.items():
        if name == "mooncake-embedded" and case.clients > 1:
            continue  # the embedded shape is measured with one client
        ratio, info = _peer_fields(ours, results.get(case.key), status, case)
        field = name.replace("-", "_")
        if name == "mooncake-embedded":
            nested.setdefault("mooncake", {})["embedded"] = {**info, "ratio": ratio}
            continue
        row[f"ratio_vs_{field}"] = ratio
        nested.setdefault(field, {}).update(info)
    row["other_core"] = ours.cpu.get("other_core")
    if ours.note:
        row["note"] = ours.note
    row["memcpy"] = {"gbps": ours.memcpy_gbps, "p50_us": ours.memcpy_p50_us}
    row.update(nested)
    row["detail"] = {
        "shape": case.shape.name,
        "pieces": len(case.shape.pieces),
        "errors": ours.errors,
        "working_set": ours.working_set,
        "calls_per_round": ours.calls_per_round,
        "rounds": ours.rounds,
        "wall_s": ours.wall_s,
        **ours.cpu,
        **note,
    }
    return row


def verify_cost(runner: Runner, case: Case, plan: Plan, on: CaseResult) -> dict[str, Any]:
    """The same read case again with checksum verification off, right after the run with
    it on (the pool's default): ``ratio_verify_on_vs_off`` is the throughput kept with it."""
    runner.set_verify("off")
    try:
        off = runner.run(case, plan)
    finally:
        runner.set_verify("on")
    return {
        "ratio_verify_on_vs_off": _ratio(on.gbps, off.gbps),
        "verify_off": {"gbps": off.gbps, "p50_us": off.p50_us, "p99_us": off.p99_us},
    }


def measure_peers(plan: Plan, workdir: str) -> dict[str, tuple[Results, str]]:
    """Each peer's results by case, and why it has none (empty when measured)."""
    peers: dict[str, tuple[Results, str]] = {}
    if "mooncake" in plan.peers:
        why = module("mooncake").missing()
        if why:
            peers["mooncake"] = ({}, f"not installed: {why}")
        else:
            remote, embedded, err = run_mooncake(plan, workdir)
            peers["mooncake"] = (remote, f"failed: {err}" if err else "")
            if plan.mooncake_embedded:
                peers["mooncake-embedded"] = (embedded, f"failed: {err}" if err else "")
    if "redis" in plan.peers:
        why = module("redis").missing()
        if why:
            peers["redis"] = ({}, f"not installed: {why}")
        else:
            try:
                peers["redis"] = (run_store("redis", plan, workdir), "")
            except Exception as e:  # noqa: BLE001 - a peer that cannot start is a note
                peers["redis"] = ({}, f"failed to start: {e}")
    return peers


def directory_rows(plan: Plan, workdir: str, note: dict[str, Any]) -> list[dict[str, Any]]:
    d = pooldir.measure(plan.directory_objects, plan.directory_fill, workdir)
    exists = {k: d.pop(k) for k in ("exists_keys", "exists_hits", "exists_p50_us", "exists_p99_us")}
    stored = f"{d['filled']} objects stored"
    head = {"nbytes": 0, "clients": 1, "condition": stored, "gbps": None}
    return [
        {
            "case": "directory",
            "op": "batch_put_from",
            **head,
            "batch": pooldir.FILL_BATCH,
            "p50_us": None,
            "p99_us": None,
            "bytes_per_object": d["bytes_per_object"],
            "directory": d,
            "detail": note,
        },
        {
            "case": "exists",
            "op": "batch_exists",
            **head,
            "batch": exists["exists_keys"],
            "p50_us": exists["exists_p50_us"],
            "p99_us": exists["exists_p99_us"],
            "detail": {"hits": exists["exists_hits"], **note},
        },
    ]


def run(ctx: BenchContext) -> Iterator[dict[str, Any]]:
    plan = make_plan(ctx)
    note = machine_note()
    with tempfile.TemporaryDirectory(prefix="kvf-bench-pool-") as workdir:
        peers = measure_peers(plan, workdir)
        max_objects = 4 * plan.working_set // (64 * KiB) + 16384
        svc = module("kvfabric").start(plan.store_capacity(), workdir, {"max_objects": max_objects})
        try:
            runner = Runner("kvfabric", svc.params, plan.client_capacities())
            try:
                runner.warm(plan.working_set)
                for case in plan.cases:
                    ours = runner.run(case, plan)
                    row = make_row(case, ours, peers, note)
                    if case.op is Op.GET:
                        row.update(verify_cost(runner, case, plan, ours))
                    yield row
            finally:
                runner.close()
        finally:
            svc.stop()
        if plan.directory_fill > 0:
            yield from directory_rows(plan, workdir, note)
