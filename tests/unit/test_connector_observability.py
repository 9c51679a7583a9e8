"""The connector's spans and KV events, with vLLM's own ``Scheduler`` and a real worker.

vLLM's scheduler (no model runs) drives the connector's scheduler role; every step's
connector metadata is pickled and unpickled, as vLLM's multiprocessing executor ships it
to the worker process, and handed to a :class:`WorkerSide` over CPU KV tensors and a real
posix store; the worker's report (released dumps, ended loads, dump reports) goes back in
the step's ``KVConnectorOutput``. A cold request stores its prompt's full blocks, a warm
one with the same prompt loads them.

Spans (OpenTelemetry SDK, in-memory exporter): one ``kvfabric.request`` root per request
with ``kvfabric.lookup`` (scheduler), ``kvfabric.load`` / ``kvfabric.dump`` (worker, whose
only link to the root is the ``traceparent`` in the unpickled plan) as children, each of
real duration inside its root, with their attributes. KV events: vLLM's scheduler
publishes kvfabric's ``BlockStored`` (vLLM's hashes and tokens of the cold request's full
blocks, medium ``STORAGE`` for posix); the batch survives vLLM's msgpack encoding and
decoding, and every block it names is in the store.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import vllm_scheduler

from kvfabric.harness.engine import kvfabric_transfer_config, vllm_problem
from kvfabric.ucm_layer.connector import tracing
from kvfabric.ucm_layer.connector.config import ConnectorConfig
from kvfabric.ucm_layer.connector.events import StoredBlocks, StoredRun, event_tier
from kvfabric.ucm_layer.connector.plan import StepPlan
from kvfabric.ucm_layer.connector.worker import WorkerSide

pytestmark = pytest.mark.skipif(bool(vllm_problem()), reason=vllm_problem() or "")

BS, NB, L = 16, 64, 3
FULL = 5
PROMPT = FULL * BS + 3  # 5 full blocks can load; the 6th holds the last prompt token


@pytest.fixture(scope="module")
def model_dir() -> str:
    from kvfabric.harness.models import tiny_llama

    return str(tiny_llama())


@pytest.fixture
def exporter():
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    out = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(out))
    from kvfabric.ucm_layer.sparse.vllm import timing as sparse_timing

    sparse_timing.clock = None  # an engine traced earlier in this process left its clock on
    tracing.use_tracer_provider(provider)
    try:
        yield out
    finally:
        from kvfabric.ucm_layer.sparse.vllm import timing

        tracing.use_tracer_provider(None)
        timing.clock = None  # a traced worker turned it on for the process


def _recorder():
    """A vLLM ``EventPublisher`` that keeps the batches (what a ZMQ publisher would send)."""
    from vllm.distributed.kv_events import EventPublisher

    class Recorder(EventPublisher):
        def __init__(self) -> None:
            super().__init__(0)
            self.batches: list = []

        def publish(self, events) -> None:
            self.batches.append(events)

        def shutdown(self) -> None:
            pass

    return Recorder()


def _worker(plat, tmp_path) -> WorkerSide:
    from kvfabric.ucm_layer.store.posix import PosixConfig, PosixStore

    def factory(layout):
        return PosixStore(
            PosixConfig(dirs=(str(tmp_path / "kv"),), io_threads=1), platform=plat, layout=layout
        )

    w = WorkerSide(
        ConnectorConfig(store="posix", posix_path=str(tmp_path / "kv")),
        plat,
        factory,
        report_dumps=True,
        dump_tier="posix",
    )
    g = torch.Generator().manual_seed(3)
    big = torch.randn(L, NB, 2, 8, 16, generator=g)
    w.register({f"model.layers.{i}.attn": big[i] for i in range(L)}, NB)
    return w


def _step(sched, w: WorkerSide):
    """One engine step: the plan crosses to the worker pickled; the worker's report (as
    vLLM's model runner collects it) goes back with one sampled token per request."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from kvfabric.ucm_layer.connector.connector import KVFabricKVEvents

    out = sched.schedule()
    plan = pickle.loads(pickle.dumps(out.kv_connector_metadata)).plan
    w.start_load(plan)
    time.sleep(0.002)  # the forward
    w.wait_for_save(plan)
    w._reap(block=True)  # the dumps of this step are in the store
    sending, recving, invalid = w.finished(), w.finished_loads(), w.failed_blocks()
    reports = w.take_reports()
    ids = list(out.num_scheduled_tokens)
    mro = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        kv_connector_output=KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            invalid_block_ids=invalid,
            kv_cache_events=KVFabricKVEvents(reports) if reports else None,
        ),
    )
    sched.update_from_output(out, mro)
    return plan


def _run(sched, w, rid: str, prompt: list[int], steps: int = 12) -> None:
    sched.add_request(vllm_scheduler.request(rid, prompt, BS, max_tokens=2))
    for _ in range(steps):
        _step(sched, w)
        if not sched.requests:
            return
    raise AssertionError(f"{rid} did not finish in {steps} steps: {list(sched.requests)}")


def test_spans_and_kv_events_across_a_pickled_plan(model_dir, tmp_path, plat, exporter):
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)
    sched = vllm_scheduler.scheduler(
        model_dir,
        kvfabric_transfer_config("posix", str(tmp_path / "kv")),
        [([f"model.layers.{i}.self_attn.attn" for i in range(4)], spec)],
        block_size=BS,
        num_blocks=NB,
        kv_events={"enable_kv_cache_events": True, "publisher": "null"},
    )
    recorder = _recorder()
    sched.kv_event_publisher = recorder
    w = _worker(plat, tmp_path)
    side = sched.connector.scheduler
    side._lookup_prefix = w.store.lookup_prefix  # the scheduler's index: the worker's store
    assert sched.connector.kv_events and side.spans.enabled and w.tracer.enabled
    prompt = list(range(100, 100 + PROMPT))
    _run(sched, w, "cold", prompt)
    _run(sched, w, "warm", prompt)
    assert w.stats.totals["loaded_blocks"] == FULL

    spans = exporter.get_finished_spans()
    roots = {s.attributes["req_id"]: s for s in spans if s.name == tracing.ROOT}
    assert set(roots) == {"cold", "warm"}
    kids: dict[tuple[str, str], list] = {}
    for s in spans:
        if s.name == tracing.ROOT:
            continue
        kids.setdefault((s.attributes["req_id"], s.name), []).append(s)
        root = roots[s.attributes["req_id"]]
        assert s.parent is not None and s.parent.span_id == root.context.span_id, s.name
        assert s.context.trace_id == root.context.trace_id
        assert root.start_time <= s.start_time < s.end_time <= root.end_time, s.name
    assert set(kids) == {
        ("cold", tracing.LOOKUP),
        ("cold", tracing.DUMP),
        ("warm", tracing.LOOKUP),
        ("warm", tracing.LOAD),
    }
    for r in roots.values():
        assert r.end_time > r.start_time and r.attributes["requested_tokens"] == PROMPT
        assert r.attributes["store"] == "posix"
    assert roots["cold"].attributes["hit_tokens"] == 0 and roots["cold"].attributes["stored_blocks"] == FULL
    assert roots["warm"].attributes["hit_tokens"] == FULL * BS
    assert roots["warm"].attributes["hit_rate"] == pytest.approx(FULL * BS / PROMPT)
    (lookup,) = kids[("warm", tracing.LOOKUP)]
    assert lookup.attributes["hit_tokens"] == FULL * BS and lookup.attributes["store_tier"] == "posix"
    (load,) = kids[("warm", tracing.LOAD)]
    assert load.attributes["blocks"] == FULL and load.attributes["store_tier"] == "posix"
    assert load.attributes["bytes"] == FULL * w.layout.block_bytes
    assert load.attributes["hit_rate"] == pytest.approx(FULL * BS / PROMPT)
    dumps = kids[("cold", tracing.DUMP)]
    assert sum(d.attributes["blocks"] for d in dumps) == FULL
    assert {d.attributes["store_tier"] for d in dumps} == {"posix"}

    # KV events: vLLM's scheduler published kvfabric's blocks, vLLM's schema both ways
    events = [e for b in recorder.batches for e in b.events if isinstance(e, BlockStored)]
    assert events, recorder.batches
    wire = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=events))
    decoded = msgspec.msgpack.Decoder(type=KVEventBatch).decode(wire).events
    assert [type(e) for e in decoded] == [BlockStored] * len(events)
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    cold = vllm_scheduler.request("x", prompt, BS)  # vLLM's block hashes of the prompt
    hashes = [bytes(h) for h in cold.block_hashes[:FULL]]
    got = [h for e in decoded for h in e.block_hashes]
    # each stored block once (the warm run loaded, stored nothing), as vLLM's events name it
    assert got == [maybe_convert_block_hash(h) for h in hashes]
    first = decoded[0]
    assert first.parent_block_hash is None and first.block_size == BS
    assert first.medium == "STORAGE" and first.ownership == "kvfabric:posix" and first.group_idx == 0
    assert [t for e in decoded for t in e.token_ids] == prompt[: FULL * BS]
    ids = sched.connector._hasher.hash_engine(hashes)  # the connector's ids of those blocks
    assert w.store.lookup(ids).all()
    assert len(side.events) == 0  # every numbered dump was reported and settled
    w.close()
    sched.shutdown()


def test_no_spans_and_no_events_by_default(model_dir, tmp_path, plat):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)
    sched = vllm_scheduler.scheduler(
        model_dir,
        kvfabric_transfer_config("posix", str(tmp_path / "kv")),
        [([f"model.layers.{i}.self_attn.attn" for i in range(4)], spec)],
        block_size=BS,
        num_blocks=NB,
    )
    side = sched.connector.scheduler
    assert not sched.connector.kv_events and not side.spans.enabled and side.events is None
    w = _worker(plat, tmp_path)
    w.report_dumps = False
    side._lookup_prefix = w.store.lookup_prefix
    sched.add_request(vllm_scheduler.request("r", list(range(PROMPT)), BS, max_tokens=1))
    plan = _step(sched, w)
    assert plan.dumps and all(t.seq == -1 for t in plan.dumps) and not plan.traces
    assert w.take_reports() == [] and not w._unsettled
    assert list(sched.connector.take_events()) == []
    w.close()
    sched.shutdown()


def test_stored_blocks_wait_for_every_rank_and_cut_runs():
    from kvfabric.ucm_layer.connector.events import DumpReport

    sb = StoredBlocks(ranks=2)
    seq = sb.next_seq()
    h = [bytes([i]) * 32 for i in range(4)]
    sb.planned(seq, np.arange(3, 7), h, [b"p" * 32, *h[:3]], [[i] * 2 for i in range(4)], 2, group=1)
    sb.report([DumpReport(seq, 0, bytes([1, 1, 1, 1]))])
    assert sb.take() == [] and len(sb) == 1  # rank 1 has not answered
    sb.report([DumpReport(seq, 1, bytes([1, 0, 1, 1]))])  # its store missed block 4
    assert sb.take() == [
        StoredRun((h[0],), b"p" * 32, (0, 0), 2, 1),
        StoredRun((h[2], h[3]), h[1], (2, 2, 3, 3), 2, 1),
    ]
    assert len(sb) == 0
    sb = StoredBlocks(ranks=1, max_pending=2)
    for _ in range(3):
        s = sb.next_seq()
        sb.planned(s, np.arange(1), h[:1], [None], [[0, 0]], 2)
    assert len(sb) == 2 and sb.dropped == 1


@pytest.mark.parametrize(
    "store,write,medium,owner",
    [
        ("cache|pool", "through", "CPU", "kvfabric:pool"),
        ("cache|posix", "through", "STORAGE", "kvfabric:posix"),
        ("cache|posix", "behind", "CPU", "kvfabric:cache"),
        ("posix", "behind", "STORAGE", "kvfabric:posix"),
        ("pool", "through", "CPU", "kvfabric:pool"),
    ],
)
def test_event_tier_names_the_tier_a_dump_speaks_for(store, write, medium, owner):
    t = event_tier(store, write)
    assert (t.medium, t.ownership) == (medium, owner)


@dataclass(frozen=True)
class _State:
    """What the sparse runtime's request state gives the clock: its id and first block."""

    rid: str
    first_block: int


def test_a_finished_requests_sparse_selection_is_a_child_of_its_root(plat, tmp_path, exporter):
    from kvfabric.ucm_layer.sparse.vllm import timing

    w = _worker(plat, tmp_path)  # tracing on: the worker turned the selection clock on
    clock = timing.clock
    assert clock is not None
    root = tracing.Tracer(None).start(tracing.ROOT, time.time_ns(), req_id="r")
    clock.step("gsa", [(0, _State("vllm-0", 7)), (1, _State("vllm-1", 9))])
    for _ in range(3):  # three layers select for both rows; each row gets half of each
        t0 = timing.now()
        time.sleep(0.002)
        clock.selected([0, 1], t0, timing.now())
    plan = StepPlan(traces={"r": tracing.traceparent(root)}, first_blocks={"r": 7})
    w.wait_for_save(pickle.loads(pickle.dumps(plan)))
    root.end(end_time=time.time_ns())
    (span,) = [s for s in exporter.get_finished_spans() if s.name == tracing.SPARSE]
    assert span.parent.span_id == root.context.span_id and span.context.trace_id == root.context.trace_id
    assert root.start_time < span.start_time < span.end_time < root.end_time
    assert span.attributes["sparse_algorithm"] == "gsa" and span.attributes["sparse_layer_steps"] == 3
    assert 0.003 <= span.attributes["selection_s"] <= (span.end_time - span.start_time) / 1e9
    assert clock.take(7) is None and clock.take(9) is not None  # taken once; the other stays
    w.close()


@pytest.mark.parametrize("batched", [True, False])
def test_the_sparse_runtime_times_each_requests_selections(tmp_path, batched):
    """The real runtime with GSA: a prefill (dense) then two decode steps past the budget
    (sparse in both layers) give the request four timed selections."""
    from kvfabric.ucm_layer.sparse.base import LayerKV, ModelSpec
    from kvfabric.ucm_layer.sparse.vllm import timing
    from kvfabric.ucm_layer.sparse.vllm.config import from_mapping
    from kvfabric.ucm_layer.sparse.vllm.runtime import SparseRuntime

    h, g, d, bs = 2, 3, 32, 32
    cfg = from_mapping({"algorithm": "gsa", "min_seq_len": 0, "min_skipped_kv": 0, "budget_tokens": 4 * bs})
    spec = ModelSpec(num_layers=2, num_q_heads=h * g, num_kv_heads=h, head_dim=d, block_size=bs)
    rt = SparseRuntime(cfg, spec, batched=batched)
    kv = LayerKV(torch.zeros(h, 64, bs, d), torch.zeros(h, 64, bs, d))
    table = torch.arange(20, dtype=torch.int32).view(1, 20) + 3  # the request's first block: 3
    clock = timing.enable()
    try:
        prompt = 10 * bs + 5
        for seq, new in ((prompt, prompt), (prompt + 1, 1), (prompt + 2, 1)):
            qsl = torch.tensor([0, new], dtype=torch.int32)
            plan = rt.plan(object(), table, torch.tensor([seq], dtype=torch.int32), qsl, kv.num_blocks)
            q, k, v = torch.randn(new, h * g, d), torch.randn(new, h, d), torch.randn(new, h, d)
            for layer in range(2):
                if plan is not None:
                    rt.layer_begin(plan, layer, (q, k, v), kv)
                    rt.layer_end(plan, layer, torch.zeros(new, h * g, d), kv)
        sel = clock.take(3)
        assert sel is not None and sel.algorithm == "gsa" and sel.sparse_layer_steps == 4
        assert 0 < sel.selection_s <= (sel.last_ns - sel.first_ns) / 1e9
        assert clock.take(3) is None
    finally:
        timing.clock = None
        rt.close()


def test_a_reused_request_id_starts_a_new_selection_clock():
    """A request that ended without its selections being taken must not lend them to a
    later request under the same id (engines reuse ids; the earlier state is another)."""
    from kvfabric.ucm_layer.sparse.vllm.timing import SelectionClock

    class State:
        def __init__(self, rid: str, first_block: int) -> None:
            self.rid, self.first_block = rid, first_block

    clock = SelectionClock()
    earlier, later = State("0", 7), State("0", 7)
    clock.step("gsa", [(0, earlier)])
    clock.selected([0], 100, 200)  # never taken
    clock.step("gsa", [(0, later)])
    clock.selected([0], 1_000, 1_300)
    sel = clock.take(7)
    assert sel is not None
    assert (sel.first_ns, sel.last_ns, sel.sparse_layer_steps) == (1_000, 1_300, 1)
    assert sel.selection_s == pytest.approx(300e-9)
