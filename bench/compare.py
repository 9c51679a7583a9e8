"""Two runs of the same benchmarks side by side: did a change move the figures?

``kvfabric compare BEFORE.jsonl AFTER.jsonl`` reads the JSON lines of two
``kvfabric bench NAME --json`` runs (any number of benchmarks concatenated), pairs the
rows that describe the same case, and reports for every ratio each row carries (a
figure against its comparison measured in the same run: ``ratio_vs_memcpy``,
``speedup_vs_dense``, ...) the value before, after, and after / before. Ratios are the
only figures compared: raw throughputs and latencies drift with the machine's load
between the two runs, the ratio to a comparison taken in the same run much less.

A case is identified by the row's text and whole-number fields other than those that
describe the run rather than the case (rounds, CPU count, load). Rows present on one side
only are listed as such, never silently dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: fields that describe the run, not the case: they never identify a row
RUN_FIELDS = frozenset({"rounds", "ncpu", "loadavg_1m", "copy_threads", "cpu_busy", "default"})


def is_ratio(name: str) -> bool:
    """Whether a row field is a figure against a comparison measured in the same run."""
    return name.startswith(("ratio", "speedup")) or "_vs_" in name


def case_key(row: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """What identifies ``row``'s case: its text, boolean and whole-number fields."""
    return tuple(
        sorted(
            (k, v)
            for k, v in row.items()
            if k not in RUN_FIELDS
            and not is_ratio(k)
            and isinstance(v, (str, bool, int))
            and not (isinstance(v, int) and not isinstance(v, bool) and k.endswith(("_us", "_ns", "_s")))
        )
    )


@dataclass(frozen=True)
class Change:
    """One ratio of one case, before and after (``None`` where that side lacks it)."""

    case: str
    field: str
    before: float | None
    after: float | None

    @property
    def change(self) -> float | None:
        """after / before, when both sides have the figure and before is not zero."""
        if self.before is None or self.after is None or self.before == 0:
            return None
        return self.after / self.before


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a ``--json`` output file, one per non-empty line; a line that is
    not a JSON object is a ``ValueError`` naming the file and line."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def _label(key: tuple[tuple[str, Any], ...]) -> str:
    d = dict(key)
    head = [str(d.pop(k)) for k in ("bench", "case", "op") if k in d]
    return " ".join(head + [f"{k}={v}" for k, v in d.items()])


def compare(before: Iterable[Mapping[str, Any]], after: Iterable[Mapping[str, Any]]) -> list[Change]:
    """Every ratio of every case of either side (first row of a case on each side wins)."""
    sides: list[dict[tuple[tuple[str, Any], ...], Mapping[str, Any]]] = [{}, {}]
    for side, rows in zip(sides, (before, after), strict=True):
        for row in rows:
            side.setdefault(case_key(row), row)
    order = list(sides[0]) + [k for k in sides[1] if k not in sides[0]]
    out = []
    for key in order:
        b, a = sides[0].get(key, {}), sides[1].get(key, {})
        fields = [f for f in {**b, **a} if is_ratio(f)]
        for f in fields:
            bv, av = b.get(f), a.get(f)
            out.append(
                Change(
                    _label(key),
                    f,
                    float(bv) if isinstance(bv, (int, float)) else None,
                    float(av) if isinstance(av, (int, float)) else None,
                )
            )
    return out
