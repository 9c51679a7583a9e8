import pytest

from kvfabric.platform.sim.cost import PRESETS, CostLedger, CostModel, LinkCost
from kvfabric.platform.types import Direction


def test_presets_exist_and_price_copies():
    assert {"ascend-a2", "ascend-a3", "cuda-h100", "cuda-a100"} <= set(PRESETS)
    m = CostModel.preset("ascend-a2")
    one_gb = m.copy_seconds(Direction.H2D, 10**9)
    assert one_gb == pytest.approx(1 / 24 + 15e-6)
    assert m.copy_seconds(Direction.D2D, 10**9) < one_gb


def test_batching_pays_one_latency():
    m = CostModel.preset("cuda-h100")
    pieces = 122
    per_piece = pieces * m.copy_seconds(Direction.H2D, 64 * 1024)
    batched = m.batch_seconds({Direction.H2D: pieces * 64 * 1024}, pieces)
    assert batched < per_piece
    assert batched == pytest.approx(6e-6 + pieces * 65536 / 55e9 + pieces * 0.05e-6)


def test_overrides_and_errors():
    m = CostModel.preset("ascend-a3").with_link(Direction.H2D, gbps=10.0)
    assert m.h2d.gbps == 10.0 and m.h2d.latency_us == PRESETS["ascend-a3"].h2d.latency_us
    with pytest.raises(ValueError, match="unknown cost model"):
        CostModel.preset("tpu")
    with pytest.raises(ValueError, match="gbps"):
        LinkCost(0, 1)


def test_ledger_totals():
    led = CostLedger()
    led.add(Direction.H2D, 1000, 1e-6, 2e-6)
    led.add(Direction.H2D, 1000, 1e-6, 2e-6)
    (row,) = led.totals()
    assert (row.copies, row.nbytes) == (2, 2000)
    assert row.wall_gbps == pytest.approx(1.0) and row.sim_gbps == pytest.approx(0.5)
    led.reset()
    assert led.totals() == []
