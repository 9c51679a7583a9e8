"""The worker role without vLLM: KV tensors, a small stateful store, step plans."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch
from mem_store import MemStore

from kvfabric.ucm_layer import hashing
from kvfabric.ucm_layer.connector.config import ConnectorConfig
from kvfabric.ucm_layer.connector.plan import StepPlan, Transfer
from kvfabric.ucm_layer.connector.worker import WorkerSide

NB, L = 12, 3


def _caches(seed):
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(L, NB, 2, 8, 16, generator=g)  # CPU-style pages, layer-outermost
    return {f"model.layers.{i}.attn": big[i] for i in range(L)}


def _ids(n, salt=0):
    return np.random.default_rng(salt).integers(0, 256, (n, 16), dtype=np.uint8)


def _worker(plat, stores, rank=0, mla=False, **cfg):
    def factory(layout):
        stores.setdefault(layout, MemStore(layout))
        return stores[layout]

    return WorkerSide(
        ConnectorConfig(store="posix", posix_path="/unused", **cfg), plat, factory, rank=rank, mla=mla
    )


@pytest.mark.parametrize("delegator", [True, False, None], ids=["delegator", "direct", "auto"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_dump_then_load_through_plans(plat, layerwise, delegator):
    stores: dict = {}
    src, dst = _caches(1), {k: torch.zeros_like(v) for k, v in _caches(1).items()}
    a = _worker(plat, stores, layerwise=layerwise, delegator=delegator)
    b = _worker(plat, stores, layerwise=layerwise, delegator=delegator)
    a.register(src, NB)
    b.register(dst, NB)
    ids = _ids(4)
    plan = StepPlan(dumps=[Transfer("r1", ids, np.array([0, 1, 2, 3]))])
    for name in src:
        a.save_layer(name, plan)
    a.wait_for_save(plan)
    a.wait_for_save(StepPlan(finished={"r1"}))
    a._reap(block=True)
    assert a.finished() == {"r1"}
    assert a.stats.totals["saved_blocks"] == 4
    load = StepPlan(loads=[Transfer("r2", ids, np.array([8, 9, 10, 11]))])
    b.start_load(load)
    for name in dst:
        b.wait_layer(name)
    assert b.failed_blocks() == set()
    assert b.stats.totals["loaded_blocks"] == 4
    for name in src:
        assert torch.equal(dst[name][8:12], src[name][0:4])
    # auto: these are host (CPU) tensors, so the store is handed the pieces directly
    assert a.cfg.delegator is (delegator if delegator is not None else False)
    assert (a.store.layout.pieces == 1) is bool(a.cfg.delegator) or layerwise
    a.close(), b.close()


def test_failed_loads_are_reported_once_and_warned_once(plat, caplog):
    stores: dict = {}
    w = _worker(plat, stores)
    w.register(_caches(2), NB)
    (store,) = stores.values()
    store.fail_loads = True
    with caplog.at_level(logging.WARNING, logger="kvfabric.connector"):
        for _ in range(3):
            w.start_load(StepPlan(loads=[Transfer("r", _ids(2, 5), np.array([4, 5]))]))
            assert w.failed_blocks() == {4, 5}
            assert w.failed_blocks() == set()
    assert len([r for r in caplog.records if "recomputes" in r.message]) == 1
    assert w.stats.totals["load_failed_blocks"] == 6
    w.close()


def test_ranks_tag_ids_and_mla_rank0_dumps(plat):
    stores: dict = {}
    r1 = _worker(plat, stores, rank=1)
    r1.register(_caches(3), NB)
    plan = StepPlan(dumps=[Transfer("r", _ids(1, 7), np.array([0]))])
    r1.wait_for_save(plan)
    r1._reap(block=True)
    (store,) = stores.values()
    (key, _), *_ = store.data
    assert hashing.rank_of(np.frombuffer(key, np.uint8).reshape(1, 16))[0] == 1
    mla1 = _worker(plat, {}, rank=1, mla=True)
    mla1.register(_caches(4), NB)
    mla1.wait_for_save(StepPlan(dumps=[Transfer("m", _ids(1, 8), np.array([0]))], finished={"m"}))
    assert mla1.stats.totals["saved_blocks"] == 0  # only rank 0 stores MLA blocks
    assert mla1.finished() == {"m"}  # but every rank reports the request released
    r1.close(), mla1.close()


def test_register_twice_is_an_error(plat):
    w = _worker(plat, {})
    w.register(_caches(5), NB)
    with pytest.raises(ValueError, match="already"):
        w.register(_caches(5), NB)
    w.close()


def test_one_load_span_per_request(plat):
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    export = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from kvfabric.ucm_layer.connector.tracing import Tracer

    exporter = export.InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    stores: dict = {}
    w = _worker(plat, stores)
    w.tracer = Tracer(None, tracer=provider.get_tracer("t"))
    w.register(_caches(6), NB)
    ids = _ids(3, 11)
    w.wait_for_save(StepPlan(dumps=[Transfer("a", ids[:2], np.array([0, 1]), 80, 8)]))
    w._reap(block=True)
    w.start_load(
        StepPlan(
            loads=[
                Transfer("a", ids[:2], np.array([4, 5]), 80, 8),
                Transfer("b", ids[2:], np.array([6]), 40, 8),  # never stored: a miss
            ]
        )
    )
    loads = {s.attributes["req_id"]: s for s in exporter.get_finished_spans() if s.name == "kvfabric.load"}
    assert loads["a"].attributes["hit_tokens"] == 16 and loads["a"].attributes["hit_rate"] == 0.2
    assert loads["b"].attributes["blocks"] == 0
    assert [s.name for s in exporter.get_finished_spans()].count("kvfabric.dump") == 1
    w.close()


def _posix_worker(plat, tmp_path, io=None, **cfg):
    """A worker over a real posix store (``io``: its file I/O, to plant faults)."""
    from kvfabric.ucm_layer.store.posix import PosixConfig, PosixStore

    made: list = []

    def factory(layout):
        s = PosixStore(PosixConfig(dirs=(str(tmp_path / "kv"),), io_threads=1), platform=plat, layout=layout)
        if io is not None:
            s.io = io
        made.append(s)
        return s

    w = WorkerSide(
        ConnectorConfig(store="posix", posix_path=str(tmp_path / "kv"), **cfg), plat, factory, rank=0
    )
    return w, made


def _finished_loads(w: WorkerSide, timeout: float = 2.0) -> set[str]:
    """Poll ``finished_loads`` until it reports something (or ``timeout`` passes)."""
    import time

    deadline = time.monotonic() + timeout
    done: set[str] = set()
    while not done and time.monotonic() < deadline:
        done = w.finished_loads()
        time.sleep(0.005)
    return done


def test_async_loads_finish_in_finished_loads_with_their_bytes(plat, tmp_path):
    src, dst = _caches(3), {k: torch.zeros_like(v) for k, v in _caches(3).items()}
    a, _ = _posix_worker(plat, tmp_path)
    a.register(src, NB)
    ids = _ids(3, 8)
    a.wait_for_save(StepPlan(dumps=[Transfer("r1", ids, np.array([0, 1, 2]))]))
    a._reap(block=True)
    b, _ = _posix_worker(plat, tmp_path, async_load=True)
    b.register(dst, NB)
    b.start_load(StepPlan(async_loads=[Transfer("r2", ids, np.array([5, 6, 7]))]))
    assert _finished_loads(b) == {"r2"} and b.loading == 0 and b.failed_blocks() == set()
    for name in src:
        assert torch.equal(dst[name][5:8], src[name][0:3])
    assert b.finished_loads() == set()  # reported once
    a.close(), b.close()


def test_an_async_load_past_load_timeout_s_is_cancelled_and_its_blocks_fail(plat, tmp_path):
    """A stalled store read: the request is reported finished once ``load_timeout_s``
    passed, its unread blocks fail (vLLM recomputes them), and the stalled reads, released
    afterwards, write nothing into the KV cache."""
    import time

    from store_faults import SlowReadIO

    src, dst = _caches(4), {k: torch.zeros_like(v) for k, v in _caches(4).items()}
    slow = SlowReadIO()
    a, _ = _posix_worker(plat, tmp_path)
    a.register(src, NB)
    ids = _ids(4, 9)
    a.wait_for_save(StepPlan(dumps=[Transfer("r1", ids, np.array([0, 1, 2, 3]))]))
    a._reap(block=True)
    b, _ = _posix_worker(plat, tmp_path, io=slow, async_load=True, load_timeout_s=0.3)
    b.register(dst, NB)
    b.start_load(StepPlan(async_loads=[Transfer("r2", ids, np.array([8, 9, 10, 11]))]))
    assert slow.started.wait(10)
    assert b.finished_loads() == set() and b.loading == 1  # not yet: before the deadline
    time.sleep(0.35)
    threading.Timer(0.05, slow.release.set).start()  # the read running at the cancel ends
    assert b.finished_loads() == {"r2"}
    failed = b.failed_blocks()
    assert failed and failed <= {8, 9, 10, 11}
    assert b.stats.totals.get("load_failed_timeout", 0) >= 1
    time.sleep(0.3)  # nothing writes the failed blocks afterwards
    for name in dst:
        for blk in failed:
            assert not dst[name][blk].any()
    # the same prefix again, the store answering now: the copy that stalled is not read
    # again (one timeout, not one per request sharing the prefix); it and the blocks after
    # it fail at once, the blocks before it load
    first = min(failed) - 8
    b.start_load(StepPlan(async_loads=[Transfer("r3", ids, np.array([4, 5, 6, 7]))]))
    assert _finished_loads(b) == {"r3"}
    assert b.failed_blocks() == set(range(4 + first, 8))
    for name in src:
        assert torch.equal(dst[name][4 : 4 + first], src[name][0:first])
    a.close(), b.close()


def test_an_idle_step_waits_briefly_for_an_async_load_instead_of_spinning(plat, tmp_path):
    """``StepPlan.idle`` (no request computes): ``finished_loads`` sleeps in short slices,
    up to ``IDLE_WAIT_S``, for a load to end, so the engine's busy loop does not keep the
    interpreter from the store's threads."""
    import time

    from store_faults import SlowReadIO

    from kvfabric.ucm_layer.connector.loads import IDLE_WAIT_S

    src, dst = _caches(5), {k: torch.zeros_like(v) for k, v in _caches(5).items()}
    a, _ = _posix_worker(plat, tmp_path)
    a.register(src, NB)
    ids = _ids(2, 11)
    a.wait_for_save(StepPlan(dumps=[Transfer("r1", ids, np.array([0, 1]))]))
    a._reap(block=True)
    slow = SlowReadIO()
    b, _ = _posix_worker(plat, tmp_path, io=slow, async_load=True)
    b.register(dst, NB)
    b.start_load(StepPlan(async_loads=[Transfer("r2", ids, np.array([3, 4]))]))  # a busy step
    assert slow.started.wait(10)
    assert b.finished_loads() == set()
    b.start_load(StepPlan(idle=True))
    t0 = time.perf_counter()
    assert b.finished_loads() == set()  # still held: waited the bound, then returned
    idle = time.perf_counter() - t0
    assert idle >= IDLE_WAIT_S * 0.9
    threading.Timer(0.005, slow.release.set).start()
    b.start_load(StepPlan(idle=True))
    deadline = time.monotonic() + 10
    done: set[str] = set()
    while not done and time.monotonic() < deadline:
        done = b.finished_loads()
    assert done == {"r2"}
    for name in src:
        assert torch.equal(dst[name][3:5], src[name][0:2])
    a.close(), b.close()


class _StalledDumps(MemStore):
    """A MemStore whose dumps never finish (a backing service that stopped answering):
    each is a real ``StoreTask`` with a job that never ends, cancelled by ``wait``'s
    timeout as every store's task is."""

    def dump(self, ids, shard_idx, addrs, after=None):
        from kvfabric.ucm_layer.store.base import TaskKind
        from kvfabric.ucm_layer.store.task import StoreTask

        ids, _, _ = self._checked(ids, shard_idx, addrs)
        task = StoreTask(self, TaskKind.DUMP, len(ids))
        task.add_job()  # never done
        task.seal()
        return task

    def check(self, task):
        return task.finished() if hasattr(task, "finished") else super().check(task)

    def wait(self, task, timeout=None):
        from kvfabric.ucm_layer.store.task import wait_task

        return wait_task(self, task, timeout) if hasattr(task, "finished") else super().wait(task, timeout)

    def cancel(self, task):
        task.cancel() if hasattr(task, "finished") else super().cancel(task)


def _stalled_worker(plat, timeout_s):
    cfg = ConnectorConfig(store="posix", posix_path="/unused", delegator=False, load_timeout_s=timeout_s)
    w = WorkerSide(cfg, plat, _StalledDumps, rank=0)
    w.register(_caches(6), NB)
    return w


def test_a_preempted_requests_dump_that_never_ends_fails_within_load_timeout_s(plat, caplog):
    """vLLM reuses a preempted request's blocks once ``preempted`` returns: a dump that
    never releases them is cancelled after ``load_timeout_s`` (its blocks fail as
    ``TIMEOUT``, a future miss, and the warning says so) instead of hanging the engine."""
    import time

    w = _stalled_worker(plat, 0.2)
    w.wait_for_save(StepPlan(dumps=[Transfer("r", _ids(3, 12), np.array([0, 1, 2]))]))
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvfabric.connector"):
        waiter = threading.Thread(target=w.wait_for_save, args=(StepPlan(preempted={"r"}),), daemon=True)
        waiter.start()
        waiter.join(5.0)
    elapsed = time.monotonic() - t0
    assert not waiter.is_alive(), "preempted() still waits on a dump that never ends"
    assert 0.18 <= elapsed < 2.0
    assert w.stats.totals["save_failed_blocks"] == 3 and w.stats.totals["saved_blocks"] == 0
    (warning,) = [r.getMessage() for r in caplog.records if "storing KV blocks" in r.getMessage()]
    assert "3 of 3 blocks: 3 timeout" in warning
    w.wait_for_save(StepPlan(finished={"r"}))
    assert w.finished() == {"r"}  # the cancelled dump released the blocks: vLLM frees them
    w.close()


def test_a_failed_dump_warning_names_the_stores_per_block_reasons(plat, tmp_path, caplog):
    """The posix store runs out of space: the warning names the store and the blocks'
    status (``failed``), logged once for a run of failures, every block counted."""
    from store_faults import FullDiskIO

    w, _ = _posix_worker(plat, tmp_path, io=FullDiskIO(0))
    w.register(_caches(7), NB)
    with caplog.at_level(logging.WARNING, logger="kvfabric.connector"):
        for salt in (13, 14):
            w.wait_for_save(StepPlan(dumps=[Transfer(f"r{salt}", _ids(2, salt), np.array([0, 1]))]))
            w._reap(block=True)
    warnings = [r.getMessage() for r in caplog.records if "storing KV blocks" in r.getMessage()]
    assert len(warnings) == 1
    assert "'posix'" in warnings[0] and "2 of 2 blocks: 2 failed" in warnings[0]
    assert w.stats.totals["save_failed_blocks"] == 4
    w.close()
