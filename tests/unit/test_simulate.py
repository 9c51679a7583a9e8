"""``kvfabric sim`` (simulate/): a replay whose hits and TTFTs are counted by hand, the
configs' bad input, the trace readers (Mooncake FAST'25, token ids, block hashes), the
synthetic generator, the routers, calibration fits, the sweep and the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvfabric.cli import main
from kvfabric.simulate.calibrate import calibrate, fit_load, fit_prefill
from kvfabric.simulate.config import (
    Calibration,
    ClusterConfig,
    Routing,
    load_calibration,
    load_cluster,
    load_synthetic,
)
from kvfabric.simulate.replay import simulate
from kvfabric.simulate.routing import PrefixAware, RoundRobin
from kvfabric.simulate.sweep import plot, recommend, run_sweep
from kvfabric.simulate.tiers import KvIndex
from kvfabric.simulate.trace import Request, default_hasher, read_jsonl, synthetic

# 4-token blocks of 64 B a token: 256 B a block, the pool's default align
TINY = {"block_tokens": 4, "kv_bytes_per_token": 64, "high_watermark": 1.0, "low_watermark": 0.75}
# prefill 1 token/s, one block loads in 1 s from DRAM, decode costs nothing
SLOW = Calibration(prefill_tokens_per_s=1.0, decode_tokens_per_s=1e12, dram_load_gbps=256e-9)


def _req(t: float, keys: str) -> Request:
    return Request(t, list(keys), 13, 1)  # 13 tokens: 3 full blocks, all 3 claimable


def test_hits_per_tier_counted_by_hand():
    """One engine, HBM of 2 blocks, DRAM of 4; watermarks 1.0 / 0.75, so a full tier evicts
    exactly its least recently used block per insert (plain LRU). Requests 100 s apart.

    R1 ABC: no hits. HBM stores A, B, C (A evicted): [B C]; DRAM [A B C].
    R2 ABD: A from DRAM, B from HBM, D misses: hbm 1, dram 1. HBM after the hits [C B],
        stores A (evicts C), D (evicts B): [A D]; DRAM after the hit [B C A], stores D:
        [B C A D].
    R3 ABC: A from HBM, B and C from DRAM: hbm 1, dram 2. HBM [D A] stores B (evicts D),
        C (evicts A): [B C]; DRAM [A D B C], nothing computed to store.
    R4 EAB: E misses: no hits. HBM stores E, A, B evicting B, C, E: [A B]; DRAM stores E
        (evicts A), A (evicts D), B is there: [B C E A].
    Lookups could claim 12 blocks: hbm 2, dram 3, hit rate 5/12. Evictions: HBM 1 + 2 + 2
    + 3 = 8, DRAM 2. TTFT (1 s per token prefilled, 1 s per DRAM block loaded): R1 13,
    R2 5 + 1 = 6, R3 1 + 2 = 3, R4 13; p50 of [13, 6, 3, 13] = 9.5.
    """
    cl = ClusterConfig(**TINY, hbm_bytes=512, dram_bytes=1024, routing=Routing.ROUND_ROBIN)
    seen = []
    rep = simulate(
        cl,
        SLOW,
        [_req(0, "ABC"), _req(100, "ABD"), _req(200, "ABC"), _req(300, "EAB")],
        on_first_token=lambda r, t, h, c: seen.append((round(t, 9), h, c)),
    )
    assert rep.lookup_blocks == 12
    assert rep.hit_blocks == {"hbm": 2, "dram": 3, "ssd": 0}
    assert rep.hit_rate == pytest.approx(5 / 12)
    assert rep.evictions == {"hbm": 8, "dram": 2, "ssd": 0}
    assert seen == [(13, 0, 3), (6, 2, 3), (3, 3, 3), (13, 0, 3)]
    assert rep.ttft_p50_s == pytest.approx(9.5)
    assert rep.bytes_loaded["dram"] == 3 * 256


def test_block_slots_answer_as_the_extent_allocator_does():
    """The replay's counter space and the pool's ExtentAllocator give the same report
    (a tier size that is not a whole number of blocks, watermark trims and evictions)."""
    syn = load_synthetic(data={"requests": 400, "prefixes": 20, "prefix_tokens_mean": 256})
    cal = Calibration(prefill_tokens_per_s=1e4, decode_tokens_per_s=1e5, dram_load_gbps=10)
    base = {"kv_bytes_per_token": 4096, "hbm_bytes": "3000KiB", "dram_bytes": "9000KiB", "ssd_bytes": "20MiB"}
    reps = [
        simulate(load_cluster(data={**base, "exact_extents": exact, "nodes": 2}), cal, synthetic(syn, 32))
        for exact in (False, True)
    ]
    a, b = (r.as_row() for r in reps)
    for r in (a, b):
        del r["wall_s"], r["peak_rss_mib"]
    assert a == b and a["evictions_dram"] > 0 and a["hit_blocks_ssd"] > 0


def test_ssd_hits_are_promoted_into_dram():
    """DRAM of 1 block, SSD of 4. R1 AB stores A, B in both (DRAM keeps B). R2 AB: A from
    SSD, B from DRAM (2 hits); A is promoted into DRAM, evicting B. R3 AB: A from DRAM,
    B from SSD."""
    cl = ClusterConfig(**TINY, dram_bytes=256, ssd_bytes=1024, routing="round-robin")
    reqs = [Request(t, ["A", "B"], 9, 1) for t in (0, 100, 200)]
    rep = simulate(cl, SLOW, reqs)
    assert rep.hit_blocks == {"hbm": 0, "dram": 2, "ssd": 2}


def test_queueing_adds_to_ttft():
    """Two 13-token requests at t = 0 on one engine: the second waits for the first."""
    cl = ClusterConfig(**TINY, dram_bytes=1024, routing="round-robin")
    rep = simulate(cl, SLOW, [_req(0, "ABC"), _req(0, "XYZ")])
    assert rep.ttft_mean_s == pytest.approx((13 + 26) / 2)
    assert rep.makespan_s == pytest.approx(26, rel=1e-6)


@pytest.mark.parametrize(
    "data,match",
    [
        ({"nodes": 0}, r"sim cluster nodes=0: expected an integer in \[1, 1000000\]"),
        ({"nodez": 2}, r"unknown sim cluster key\(s\) \['nodez'\]; known: \["),
        ({"routing": "random"}, "sim cluster routing='random': expected one of round-robin, prefix-aware"),
        ({"dram_bytes": "12 parsecs"}, "sim cluster dram_bytes="),
        ({"high_watermark": 0.5, "low_watermark": 0.7}, "watermarks"),
        ({"dram_bytes": 1000}, r"dram_bytes=1000: smaller than one block \(4194304 B\)"),
        ({"dram_bytes": 0}, "every tier is 0 bytes"),
        ({"price": {"node_hour": -1}}, r"sim cluster price.node_hour=-1: expected a number >= 0"),
    ],
)
def test_cluster_bad_input_names_the_key(data, match):
    with pytest.raises(ValueError, match=match):
        load_cluster(data=data)


def test_config_files_flags_and_other_bad_input(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("nodes: 4\ndram_bytes: 8GiB\nprice:\n  node_hour: 2.5\n")
    cl = load_cluster(f, flags=["engines_per_node=2", "price.dram_gib_hour=0.01"])
    assert (cl.nodes, cl.engines, cl.dram_bytes, cl.price.node_hour) == (4, 8, 8 << 30, 2.5)
    assert cl.price.dram_gib_hour == 0.01
    with pytest.raises(ValueError, match="sim cluster nodes='x'"):
        cl.with_value("nodes", "x")
    with pytest.raises(ValueError, match="sim calibration key dram_load_gbps is required"):
        load_calibration(data={"prefill_tokens_per_s": 1, "decode_tokens_per_s": 1})
    with pytest.raises(ValueError, match="sim calibration prefill_tokens_per_s=0: expected a number > 0"):
        load_calibration(data={"prefill_tokens_per_s": 0, "decode_tokens_per_s": 1, "dram_load_gbps": 1})
    with pytest.raises(
        ValueError, match=r"sim synthetic diurnal_swing='1.5': expected a number in \[0, 0.99\]"
    ):
        load_synthetic(flags=["diurnal_swing=1.5"])


def test_mooncake_trace_reader(tmp_path):
    p = tmp_path / "mooncake.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1100, "output_length": 12, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 600, "output_length": 3, "hash_ids": [0, 3]},
    ]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = list(read_jsonl(p, 512))
    assert [(r.arrival_s, list(r.keys), r.prompt_tokens, r.output_tokens) for r in reqs] == [
        (0.0, [0, 1, 2], 1100, 12),
        (1.5, [0, 3], 600, 3),
    ]
    p.write_text(json.dumps(lines[1]) + "\n" + json.dumps(lines[0]) + "\n")
    with pytest.raises(ValueError, match=r"line 2: arrives at 0\.0 s, before the line above"):
        list(read_jsonl(p, 512))
    p.write_text(json.dumps({"timestamp": 1, "input_length": "9", "output_length": 1, "hash_ids": []}) + "\n")
    with pytest.raises(ValueError, match="line 1: input_length='9' is not a int"):
        list(read_jsonl(p, 512))
    p.write_text('{"arrival_s": 1}\n')
    with pytest.raises(ValueError, match="needs 'tokens', 'hash_ids'"):
        list(read_jsonl(p, 512))


def test_token_trace_is_keyed_by_kvfabric_block_ids(tmp_path):
    p = tmp_path / "t.jsonl"
    a, b = list(range(1, 11)), [*range(1, 9), 77, 78, 79]
    p.write_text(json.dumps({"arrival_s": 0, "tokens": a}) + "\n" + json.dumps({"arrival_s": 1, "tokens": b}))
    r1, r2 = read_jsonl(p, 4)
    ids = default_hasher(4).hash_tokens(a)
    assert r1.keys == [bytes(row) for row in ids] and len(r1.keys) == 2
    assert r1.keys == r2.keys  # same first 8 tokens; 9.. are a partial block
    assert (r1.prompt_tokens, r2.prompt_tokens) == (10, 11)


def test_synthetic_is_deterministic_and_shares_prefixes():
    cfg = load_synthetic(data={"requests": 200, "prefixes": 3, "system_tokens": 64, "seed": 5})
    one, two = list(synthetic(cfg, 32)), list(synthetic(cfg, 32))
    assert [r.keys for r in one] == [r.keys for r in two]
    assert all(r.keys[:2] == one[0].keys[:2] for r in one)  # the system prompt's 2 blocks
    arrivals = [r.arrival_s for r in one]
    assert arrivals == sorted(arrivals)
    assert 200 / arrivals[-1] == pytest.approx(10, rel=0.3)  # qps 10
    firsts = {r.keys[2] for r in one if len(r.keys) > 2}
    assert len(firsts) <= 3 + 200  # prefix blocks come from 3 prefixes (or a short prefix's suffix)


def test_routers():
    rr = RoundRobin(3)
    assert [rr.route([], [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    idx = KvIndex()
    for k in "ab":
        idx.stored(k, 2)
    idx.stored("a", 0)
    pa = PrefixAware(idx, engines_per_node=2, engines=8, slack=4)
    load = [0] * 8
    assert pa.route(["a", "b", "c"], load) in (4, 5)  # node 2 holds the longest prefix
    load[4] = 1
    assert pa.route(["a", "b"], load) == 5  # the less loaded engine of node 2
    load[4] = load[5] = 10
    assert pa.route(["a", "b"], load) not in (4, 5)  # over the slack: elsewhere
    idx.dropped("b", 2)
    idx.dropped("a", 2)
    assert idx.nodes("a") == 0 and idx.nodes("b") is None


def test_prefix_aware_routing_beats_round_robin_on_shared_prefixes():
    syn = load_synthetic(data={"requests": 600, "prefixes": 40, "qps": 50, "prefix_tokens_mean": 512})
    cal = Calibration(prefill_tokens_per_s=1e5, decode_tokens_per_s=1e5, dram_load_gbps=10)
    rates = {}
    for routing in ("round-robin", "prefix-aware"):
        cl = load_cluster(
            data={"nodes": 8, "dram_bytes": "1GiB", "kv_bytes_per_token": 4096, "routing": routing}
        )
        rates[routing] = simulate(cl, cal, synthetic(syn, 32)).hit_rate
    assert rates["prefix-aware"] > rates["round-robin"]


def test_fit_prefill_recovers_the_terms():
    pts = [(n, 0, 0.05 + n / 2000 + 1e-7 * n * n / 2) for n in (256, 1024, 4096)]
    base, tps, attn = fit_prefill(pts)
    assert (base, tps, attn) == (pytest.approx(0.05), pytest.approx(2000), pytest.approx(1e-7))


def test_fit_prefill_of_points_growing_faster_than_a_line_keeps_a_per_token_cost():
    # probes of a loaded run (a tiny model): the three-term fit drove the per-token term
    # negative and the fit refused points that grow with length; now the attention term goes
    base, tps, attn = fit_prefill([(96, 0, 0.027), (320, 0, 0.033), (640, 0, 0.057)])
    assert attn == 0 and tps > 0 and base > 0
    assert base + 640 / tps == pytest.approx(0.057, rel=0.15)  # a line through them
    with pytest.raises(ValueError, match="does not grow"):
        fit_prefill([(96, 0, 0.05), (320, 0, 0.04), (640, 0, 0.03)])


def test_fit_load_line_and_unresolved_per_byte_cost():
    line = [(b, 0.1 + b / 2e9) for b in (1e6, 4e6, 9e6)]
    assert fit_load(line) == (pytest.approx(0.1), pytest.approx(2.0))
    falling = [(1e6, 1.0), (2e6, 0.95), (3e6, 0.9)]  # noise: the time does not grow with bytes
    fixed, gbps = fit_load(falling, memcpy_gbps=0.1)  # 10 ms a MB
    assert gbps == 0.1 and fixed == pytest.approx(0.95 - 0.02)


def test_calibrate_from_bench_rows_and_what_is_missing():
    block = 30 * 48 * 1024
    rows = [{"case": "delegator", "layout": "smollm2-cpu-pages", "nbytes": 64 * block}]
    for n in (512, 2048, 7000):
        cold = 0.1 + n / 1000
        loaded = (n - 1) // 32
        warm = 0.1 + (n - loaded * 32) / 1000 + loaded * block / 2e9  # 2 GB/s
        rows.append({"case": "ttft", "prompt_tokens": n, "ttft_cold_s": cold, "ttft_kvfabric_s": warm,
                     "loaded_blocks": loaded})  # fmt: skip
    rows.append({"store": "posix", "op": "load", "gbps": 1.5})
    with pytest.raises(ValueError, match="decode_tokens_per_s is neither in the rows nor given"):
        calibrate(rows)
    cal = calibrate(rows, ["decode_tokens_per_s=300"])
    assert cal.prefill_tokens_per_s == pytest.approx(1000)
    assert cal.dram_load_gbps == pytest.approx(2.0)
    assert cal.ssd_load_gbps == 1.5 and cal.decode_tokens_per_s == 300
    assert "bench e2e" in cal.source


def test_calibrate_reads_bench_copy_and_rpc_rows():
    """``bench copy``'s cross-process reads at the largest size give the DRAM load rate (the
    median over page kinds; writes and smaller sizes are not loads of a block), ``bench
    rpc``'s smallest spin p50 the lookup."""
    rows = [
        {"case": "cross-process", "op": "read", "pages": p, "nbytes": n, "gbps": g}
        for p, n, g in [("4k", 1 << 20, 9.0), ("4k", 64 << 20, 4.0), ("thp", 64 << 20, 6.0),
                        ("hugetlb", 64 << 20, 8.0)]
    ]  # fmt: skip
    rows += [
        {"case": "cross-process", "op": "write", "pages": "4k", "nbytes": 64 << 20, "gbps": 1.0},
        {"case": "in-process", "op": "h2d", "nbytes": 64 << 20, "gbps": 20.0},
        {"case": "one client", "rpc_p50_us_spin": 31.0},
        {"case": "4 clients", "rpc_p50_us_spin": 55.0},
    ]
    cal = calibrate(rows, ["prefill_tokens_per_s=500", "decode_tokens_per_s=20"])
    assert cal.dram_load_gbps == 6.0
    assert cal.lookup_rpc_s == pytest.approx(31e-6)
    assert "bench copy" in cal.source and "bench rpc" in cal.source
    with pytest.raises(ValueError, match="prefill_tokens_per_s is neither in the rows nor given"):
        calibrate(rows, ["decode_tokens_per_s=20"])


def test_sweep_recommends_the_smallest_sizing_and_plots(tmp_path):
    syn = load_synthetic(data={"requests": 300, "prefixes": 30, "prefix_tokens_mean": 512})
    cl = load_cluster(data={"dram_bytes": "64MiB", "kv_bytes_per_token": 4096, "routing": "round-robin"})
    cal = Calibration(prefill_tokens_per_s=1e4, decode_tokens_per_s=1e5, dram_load_gbps=10)
    pts = run_sweep(cl, cal, "dram_bytes", ["8MiB", "32MiB", "128MiB"], lambda: synthetic(syn, 32))
    rates = [p.report.hit_rate for p in pts]
    assert rates == sorted(rates) and rates[0] < rates[-1]
    best = recommend(pts, rates[1])
    assert best is not None and best.text == "32MiB"
    assert recommend(pts, 1.01) is None
    png = plot(pts, tmp_path / "plots", target=rates[1])
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"


def test_cli_json_rows(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "\n".join(json.dumps({"arrival_s": i, "hash_ids": [1, 2, 3], "prompt_tokens": 100}) for i in range(5))
    )
    args = ["sim", "--trace", str(trace), "--set", "dram_bytes=1GiB", "--no-progress", "--json"]
    cal = [
        "--cal",
        "prefill_tokens_per_s=1000",
        "--cal",
        "decode_tokens_per_s=100",
        "--cal",
        "dram_load_gbps=5",
    ]
    assert main(args + cal) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["requests"] == 5 and row["hit_blocks_dram"] == 4 * 3
    assert main(["sim", "--trace", str(trace), "--set", "nodes=0", *cal]) == 2
    assert "sim cluster nodes='0'" in capsys.readouterr().err
    assert np.isfinite(row["ttft_p50_s"])


def test_cli_calibrate_writes_what_sim_reads(tmp_path, capsys):
    rows = tmp_path / "bench.jsonl"
    ttft = [{"case": "ttft", "prompt_tokens": n, "ttft_cold_s": 0.1 + n / 1000} for n in (512, 2048)]
    rows.write_text("log line\n" + "\n".join(json.dumps(r) for r in ttft) + "\n")
    out = tmp_path / "cal.yaml"
    args = ["sim", "calibrate", str(rows), "-o", str(out)]
    assert main([*args, "--cal", "decode_tokens_per_s=50"]) == 2  # no dram_load_gbps measured
    assert "dram_load_gbps is neither in the rows nor given" in capsys.readouterr().err
    assert main([*args, "--cal", "decode_tokens_per_s=50", "--cal", "dram_load_gbps=3"]) == 0
    cal = load_calibration(out)
    assert cal.prefill_tokens_per_s == pytest.approx(1000) and cal.dram_load_gbps == 3
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"arrival_s": 0, "hash_ids": [1, 2], "prompt_tokens": 70}) + "\n")
    assert main(["sim", "--trace", str(trace), "--calibration", str(out), "--no-progress", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert row["ttft_p50_s"] == pytest.approx(cal.prefill_s(70, 0))


def test_a_validate_rows_comparison_fields():
    from kvfabric.simulate.validate import _compared

    row = _compared(0.52, 0.50, [0.1, 0.2, 0.3], [0.1, 0.25, 0.4])
    assert row["hit_rate_diff_points"] == 2.0 and row["hit_within_5_points"]
    assert (row["predicted_ttft_p50_s"], row["measured_ttft_p50_s"]) == (0.2, 0.25)
    assert row["ttft_p50_rel_error"] == 0.2 and row["ttft_within_25_percent"]
    assert not _compared(0.6, 0.5, [0.1], [0.2])["hit_within_5_points"]


def test_the_decode_probe_compares_requests_that_loaded_the_same_blocks() -> None:
    # a small stateful engine: the prompt is evicted after the first request that loads it,
    # so a probe that skipped the warming request would time a cold 1-token request against
    # a warm 17-token one (a negative difference, once a 16,000,000 tokens/s calibration)
    from kvfabric.simulate.validate import decode_rate

    state = {"resident": False}
    calls: list[int] = []

    def send(prompt: list[int], out: int) -> tuple[float, int]:
        calls.append(out)
        loaded = 4 if state["resident"] else 0
        state["resident"] = True
        prefill = 0.05 if loaded else 1.0
        return prefill + 0.02 * (out - 1), loaded

    assert abs(decode_rate(send, [1, 2, 3]) - 16 / (0.02 * 16)) < 1e-6
    assert calls == [1, 1, 17]

    def never_slower(prompt: list[int], out: int) -> tuple[float, int]:
        return 0.1, 4

    with pytest.raises(RuntimeError, match="decode probe"):
        decode_rate(never_slower, [1])
