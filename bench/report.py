"""Running a benchmark and printing its rows: a table for people, JSON lines for tools."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

from kvfabric.bench import BENCHMARKS

Row = dict[str, Any]


@dataclass(frozen=True)
class BenchContext:
    """What a benchmark is asked to do: ``quick`` trims sizes and rounds for CI-sized runs."""

    quick: bool = False
    rounds: int = 5
    platform: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


def cpu_busy_fraction(interval_rows: tuple[list[int], list[int]]) -> float:
    """System-wide busy fraction between two ``/proc/stat`` cpu rows."""
    a, b = interval_rows
    idle = (b[3] + b[4]) - (a[3] + a[4])
    total = sum(b) - sum(a)
    return 1.0 - idle / total if total > 0 else 0.0


def read_cpu_row() -> list[int]:
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return [0] * 10


def machine_note() -> dict[str, Any]:
    """Facts a reader needs to judge a figure: cores and load when it was taken."""
    try:
        load1 = os.getloadavg()[0]
    except OSError:
        load1 = -1.0
    return {"ncpu": os.cpu_count(), "loadavg_1m": round(load1, 2)}


def load(name: str) -> Callable[[BenchContext], Iterator[Row]]:
    return BENCHMARKS.load(name)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def run(name: str, ctx: BenchContext, as_json: bool, out: TextIO = sys.stdout) -> list[Row]:
    """Run benchmark ``name``; print JSON lines (``as_json``) or a table; return the rows."""
    from rich.console import Console
    from rich.table import Table

    fn = load(name)
    err = Console(stderr=True)
    rows: list[Row] = []
    t0 = time.perf_counter()
    with err.status(f"kvfabric bench {name}{' --quick' if ctx.quick else ''} ...") as status:
        for row in fn(ctx):
            row = {"bench": name, **row}
            rows.append(row)
            status.update(
                f"kvfabric bench {name}: {len(rows)} case(s) done, last: "
                f"{row.get('case', '')} {row.get('nbytes', '')}"
            )
            if as_json:
                out.write(json.dumps(row, sort_keys=False) + "\n")
                out.flush()
    if not as_json and rows:
        keys: list[str] = []
        for r in rows:
            keys += [k for k in r if k not in keys and not isinstance(r[k], (dict, list))]
        table = Table(title=f"kvfabric bench {name} ({time.perf_counter() - t0:.1f} s)")
        for k in keys:
            table.add_column(k, justify="right" if isinstance(rows[0].get(k), (int, float)) else "left")
        for r in rows:
            table.add_row(*[_fmt(r.get(k, "")) for k in keys])
        Console(file=out).print(table)
    return rows
