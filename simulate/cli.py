"""``kvfabric sim [run|calibrate|validate]``: the simulator's command line.

* ``kvfabric sim --trace T | --synthetic [F] --cluster C --calibration K [--json]
  [--sweep KEY=V1,V2,... [--target-hit-rate X] [--plot DIR]]``: replay and report
  (``--set``, ``--syn``, ``--cal`` set single keys of the cluster, the synthetic trace and
  the calibration over their files);
* ``kvfabric sim calibrate BENCH.jsonl... [--cal KEY=VALUE] -o calibration.yaml``;
* ``kvfabric sim validate [--quick] [--workload trace|serve] [--json] [--out DIR]``:
  predicted against measured on a CPU vLLM engine (``validate.py``; ``serve``: the
  workload of ``kvfabric bench serve``).

A bad key or value exits with status 2 and one line naming it (``kvfabric.cli``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

ACTIONS = ("run", "calibrate", "validate")


def add_parser(sub: Any) -> None:
    """Register ``sim`` on the ``kvfabric`` subparsers ``sub``."""
    s = sub.add_parser("sim", help="simulate a KV-cache pool deployment over a request trace (docs/sim.md)")
    s.add_argument(
        "action", nargs="?", choices=ACTIONS, default="run", help="run (default), calibrate, validate"
    )
    s.add_argument("files", nargs="*", help="calibrate: files of `kvfabric bench ... --json` rows")
    s.add_argument("--trace", help="JSONL trace: token ids, block hashes or Mooncake FAST'25 lines")
    s.add_argument(
        "--synthetic",
        nargs="?",
        const="",
        default=None,
        metavar="FILE",
        help="generate the trace (YAML keys)",
    )
    s.add_argument("--syn", action="append", default=[], metavar="KEY=VALUE", help="a synthetic trace key")
    s.add_argument("--cluster", metavar="FILE", help="cluster YAML (nodes, engines, tiers, routing, price:)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a cluster key")
    s.add_argument("--calibration", metavar="FILE", help="calibration YAML (kvfabric sim calibrate)")
    s.add_argument("--cal", action="append", default=[], metavar="KEY=VALUE", help="a calibration key")
    s.add_argument("--sweep", metavar="KEY=V1,V2,...", help="replay once per value of one cluster key")
    s.add_argument("--target-hit-rate", type=float, default=None, help="sweep: the sizing to recommend")
    s.add_argument("--plot", metavar="DIR", help="sweep: write the PNG plot into DIR")
    s.add_argument("--json", action="store_true", help="one JSON object per line")
    s.add_argument("--quick", action="store_true", help="validate: the small trace")
    s.add_argument(
        "--workload",
        choices=("trace", "serve"),
        default="trace",
        help="validate: its own trace, one request at a time (default), or bench serve's workload",
    )
    s.add_argument("--out", "-o", default=None, help="calibrate: the YAML to write; validate: a directory")
    s.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    s.set_defaults(fn=main)


def _trace_factory(
    args: argparse.Namespace, block_tokens: int
) -> tuple[Callable[[], Iterable[Any]], int | None]:
    from kvfabric.simulate.config import load_synthetic
    from kvfabric.simulate.trace import count_lines, read_jsonl, synthetic

    if (args.trace is None) == (args.synthetic is None):
        raise ValueError("give exactly one of --trace FILE and --synthetic [FILE]")
    if args.trace is not None:
        path = args.trace
        return (lambda: read_jsonl(path, block_tokens)), count_lines(path)
    syn = load_synthetic(args.synthetic or None, flags=args.syn)
    return (lambda: synthetic(syn, block_tokens)), syn.requests


def _row(rep: Any, **extra: Any) -> dict[str, Any]:
    return {"case": "sim", **extra, **rep.as_row()}


def _print_table(rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table("figure", *[str(r.get("value", "")) or "value" for r in rows], title=title)
    keys = [k for k in rows[0] if k not in ("case", "key", "value")]
    for k in keys:
        cells = []
        for r in rows:
            v = r.get(k)
            cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        t.add_row(k, *cells)
    Console().print(t)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvfabric.simulate.config import load_calibration, load_cluster
    from kvfabric.simulate.replay import simulate
    from kvfabric.simulate.sweep import parse_sweep, plot, recommend, run_sweep

    cluster = load_cluster(args.cluster, flags=args.set)
    cal = load_calibration(args.calibration, flags=args.cal)
    trace, total = _trace_factory(args, cluster.block_tokens)
    sweep = parse_sweep(args.sweep) if args.sweep else None
    if sweep:
        [cluster.with_value(sweep[0], v) for v in sweep[1]]  # every value checked before the first run
    if (args.plot or args.target_hit_rate is not None) and not sweep:
        raise ValueError("--plot and --target-hit-rate go with --sweep KEY=V1,V2,...")
    show = not args.no_progress
    prog = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not show,
    )
    rows: list[dict[str, Any]] = []
    with prog:
        if sweep is None:
            task = prog.add_task("kvfabric sim", total=total)
            rep = simulate(cluster, cal, trace(), lambda n: prog.update(task, completed=n))
            rows.append(_row(rep))
        else:
            key, values = sweep
            tasks = {v: prog.add_task(f"{key}={v}", total=total) for v in values}
            points = run_sweep(
                cluster, cal, key, values, trace, lambda v, n: prog.update(tasks[v], completed=n)
            )
            rows += [_row(p.report, key=key, value=p.text) for p in points]
    if sweep is not None:
        best = recommend(points, args.target_hit_rate) if args.target_hit_rate is not None else None
        if args.plot:
            path = plot(points, args.plot, args.target_hit_rate)
            print(f"plot: {path}", file=sys.stderr)
        if args.target_hit_rate is not None:
            rec = {
                "case": "recommendation",
                "key": sweep[0],
                "target_hit_rate": args.target_hit_rate,
                "value": best.text if best else None,
                "hit_rate": best.report.hit_rate if best else None,
                "ttft_p50_s": best.report.ttft_p50_s if best else None,
            }
    if args.json:
        for r in rows:
            print(json.dumps(r))
        if sweep is not None and args.target_hit_rate is not None:
            print(json.dumps(rec))
        return 0
    _print_table(rows, f"kvfabric sim: {cluster.nodes} node(s) x {cluster.engines_per_node} engine(s)")
    if sweep is not None and args.target_hit_rate is not None:
        if best is None:
            print(f"no {sweep[0]} swept reaches a hit rate of {args.target_hit_rate:g}")
        else:
            print(
                f"smallest {sweep[0]} reaching a hit rate of {args.target_hit_rate:g}: {best.text} "
                f"(hit rate {best.report.hit_rate:.3f}, TTFT p50 {best.report.ttft_p50_s:.4g} s)"
            )
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from kvfabric.simulate.calibrate import calibrate, read_rows
    from kvfabric.simulate.config import save_calibration

    if not args.files:
        raise ValueError("kvfabric sim calibrate needs files of `kvfabric bench ... --json` rows")
    cal = calibrate(read_rows(args.files), args.cal)
    if args.out:
        save_calibration(cal, args.out)
    if args.json or not args.out:
        print(json.dumps({"case": "calibration", **asdict(cal)}))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from kvfabric.simulate import validate

    go = validate.run_serve if args.workload == "serve" else validate.run
    rows = list(go(quick=args.quick, out_dir=args.out))
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        _print_table([{k: v for k, v in r.items()} for r in rows[:1]], "kvfabric sim validate")
        print(json.dumps(rows[1]))
    return 0


def main(args: argparse.Namespace) -> int:
    """Run the ``sim`` action ``args.action``."""
    if args.action == "calibrate":
        return _calibrate(args)
    if args.action == "validate":
        return _validate(args)
    if args.files:
        raise ValueError(f"kvfabric sim: unexpected argument(s) {args.files}")
    return _run(args)


__all__ = ["add_parser", "main"]
