"""``kvfabric bench rpc`` runs its three conditions with real daemons and client processes
and reports both settings and their ratio."""

from __future__ import annotations

import pytest
from kvf_testing import segments

from kvfabric.bench.report import BenchContext
from kvfabric.bench.rpc import CONDITIONS, run


@pytest.mark.slow
def test_bench_rpc_small_run(isolated_shm):
    rows = list(run(BenchContext(quick=True, options={"puts": 64, "rounds": 1})))
    assert [r["case"] for r in rows] == [c[0] for c in CONDITIONS]
    for r, (_case, clients, busy) in zip(rows, CONDITIONS):
        for k in ("put_p50_us_spin", "put_p50_us_nospin", "rpc_p50_us_spin", "rpc_p50_us_nospin"):
            assert r[k] > 0
        assert r["ratio_nospin_over_spin"] == pytest.approx(  # the ratio is rounded to 0.01
            r["put_p50_us_nospin"] / r["put_p50_us_spin"], rel=0.02, abs=0.006
        )
        d = r["detail"]
        assert (d["clients"], d["other_core_busy"], d["puts"], d["rounds"]) == (clients, busy, 64, 1)
    assert segments(isolated_shm) == []  # every daemon and client cleaned up
