"""``kvfabric compare``: rows of two runs paired by case, ratios side by side."""

import json
import subprocess
import sys

import pytest

from kvfabric.bench.compare import case_key, compare, read_rows


def _row(op: str, nbytes: int, ratio: float, **extra: object) -> dict:
    return {
        "bench": "copy",
        "case": "in-process",
        "op": op,
        "nbytes": nbytes,
        "gbps": 2.0 * ratio,
        "ratio_vs_memcpy": ratio,
        "rounds": 5,
        "loadavg_1m": 3.1,
        **extra,
    }


def test_rows_pair_by_case_not_by_run_fields():
    before = [_row("h2d", 1 << 20, 0.8), _row("d2h", 1 << 20, 0.5)]
    after = [_row("d2h", 1 << 20, 0.6, rounds=9, loadavg_1m=0.2), _row("h2d", 1 << 20, 0.4)]
    got = {(c.case, c.field): c for c in compare(before, after)}
    h2d = got[("copy in-process h2d nbytes=1048576", "ratio_vs_memcpy")]
    assert (h2d.before, h2d.after, h2d.change) == (0.8, 0.4, 0.5)
    d2h = got[("copy in-process d2h nbytes=1048576", "ratio_vs_memcpy")]
    assert d2h.change == pytest.approx(1.2)
    assert len(got) == 2  # gbps is not a ratio: never compared


def test_case_on_one_side_only_is_listed_with_none():
    changes = compare([_row("h2d", 1, 0.8)], [_row("h2d", 2, 0.9)])
    assert {(c.before, c.after) for c in changes} == {(None, 0.9), (0.8, None)}
    assert all(c.change is None for c in changes)


def test_latency_fields_do_not_split_a_case():
    assert case_key(_row("h2d", 1, 0.8, p50_us=12)) == case_key(_row("h2d", 1, 0.8, p50_us=99))


def test_bad_line_names_file_and_line(tmp_path):
    p = tmp_path / "run.jsonl"
    p.write_text(json.dumps(_row("h2d", 1, 0.8)) + "\n\nnot json\n")
    with pytest.raises(ValueError, match=r"run.jsonl:3: not a JSON line"):
        read_rows(p)


def test_command_line_prints_json_changes(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(_row("h2d", 1, 0.5)) + "\n")
    b.write_text(json.dumps(_row("h2d", 1, 0.75)) + "\n")
    out = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "compare", str(a), str(b), "--json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    (line,) = [json.loads(x) for x in out.splitlines()]
    assert line["field"] == "ratio_vs_memcpy" and line["after_over_before"] == pytest.approx(1.5)
