"""The pure parts of ``kvfabric bench cluster``: its plan, the hit-rate math, the rows."""

from __future__ import annotations

import pytest

from kvfabric.bench import cluster as cl
from kvfabric.bench.cluster_client import block_keys, content, digest
from kvfabric.bench.report import BenchContext


def _reads(node: str, lookups: int, hits: int, dirty: int = 0, max_call_s: float = 0.1) -> cl.Reads:
    return cl.Reads(node, lookups, hits, dirty, 0, lookups // 4, max_call_s)


def test_hit_rate_is_hits_over_lookups_of_all_reads_together() -> None:
    assert cl.hit_rate([_reads("a", 800, 800), _reads("b", 800, 400)]) == 0.75
    assert cl.hit_rate([_reads("a", 3, 2)]) == round(2 / 3, 4)
    assert cl.hit_rate([]) is None and cl.hit_rate([_reads("a", 0, 0)]) is None
    assert cl.drop(1.0, 0.665) == 0.335
    assert cl.drop(0.8, 0.8) == 0.0
    assert cl.drop(None, 0.5) is None and cl.drop(0.0, 0.5) is None


def test_served_again_counts_only_puts_accepted_after_the_kill() -> None:
    during = [{"first_put_ok_after": 101.5}, {"first_put_ok_after": 99.0}, {"first_put_ok_after": 0.0}]
    assert cl.served_again_s(during, 100.0) == 1.5
    assert cl.served_again_s([{"first_put_ok_after": 0.0}], 100.0) is None


def test_a_failover_row_has_the_issue_fields_and_takes_survivors_only() -> None:
    plan = cl.Plan(prefixes=6, blocks=2, block_bytes=1024, window_bytes=1 << 20)
    before = [_reads("n0", 12, 12), _reads("n1", 12, 12), _reads("n2", 12, 6, dirty=1, max_call_s=0.3)]
    after = [_reads("n0", 12, 8, max_call_s=1.2), _reads("n2", 12, 8)]
    during = [_reads("n0", 20, 10, max_call_s=1.4), _reads("n2", 20, 12)]
    row = cl.failover_row(
        case="leader",
        killed=cl.Killed("n1", "leader"),
        before=before,
        after=after,
        during=during,
        failover_s=2.1,
        served_again_s=3.0,
        rejoin=cl.Rejoin(2.5, 16, 16, 16, 0),
        plan=plan,
    )
    assert set(cl.ROW_FIELDS) <= set(row)
    assert row["case"] == "kill-leader" and row["replicas"] == 1
    assert row["hit_rate_before"] == 0.75  # n0 and n2 (the killed n1's reads are not the survivors')
    assert row["hit_rate_after"] == round(16 / 24, 4)
    assert row["hit_rate_drop"] == round(1 - (16 / 24) / 0.75, 4)
    assert row["dirty_reads"] == 1 and row["max_call_s"] == 1.4
    assert row["max_call_s_by_phase"] == {"before": 0.3, "during": 1.4, "after": 1.2}
    assert row["failover_s"] == 2.1 and row["rejoined"] is True
    by_node = {c["node"]: c for c in row["clients"]}
    assert by_node["n1"]["killed"] and by_node["n1"]["hit_rate_after"] is None
    assert by_node["n2"]["hit_rate_before"] == 0.5


def test_throughput_rows_carry_the_ratio_or_say_why_mooncake_is_missing() -> None:
    plan = cl.Plan()
    ours = {"put_gbps": 0.5, "get_gbps": 0.9, "failed": 0, "wrong_rounds": 0, "first_gva_rank": 4}
    theirs = {"put_gbps": 1.0, "get_gbps": 0.6, "failed": 0, "wrong_rounds": 0}
    put, get = cl.throughput_rows(ours, theirs, None, plan, 4)
    assert (put["case"], put["ratio_vs_mooncake"], put["mooncake_gbps"]) == ("cross-node-put", 0.5, 1.0)
    assert get["ratio_vs_mooncake"] == 1.5 and get["mooncake"]["status"] == "ok"
    put, _ = cl.throughput_rows(ours, None, "Mooncake Store is not installed", plan, 4)
    assert put["ratio_vs_mooncake"] is None and put["mooncake"]["status"] == "Mooncake Store is not installed"


def test_the_plan_checks_itself_and_quick_is_smaller() -> None:
    quick, full = cl.make_plan(BenchContext(quick=True)), cl.make_plan(BenchContext())
    assert quick.block_bytes < full.block_bytes and quick.cases == full.cases == cl.CASES
    assert cl.make_plan(BenchContext(options={"prefixes": 10, "cases": ["leader"]})).cases == ("leader",)
    with pytest.raises(ValueError, match="cluster case"):
        cl.Plan(cases=("everyone",))
    with pytest.raises(ValueError, match="does not fit"):
        cl.Plan(window_bytes=1 << 20)


def test_every_client_knows_what_a_key_holds() -> None:
    a, b = content("c/p1/b0", 4096), content("c/p1/b1", 4096)
    assert a == content("c/p1/b0", 4096) and a != b and len(a) == 4096
    assert digest(a) != digest(b)
    assert block_keys("c", 3, 2) == ["c/p3/b0", "c/p3/b1"]
