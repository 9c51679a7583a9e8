"""The connector with several KV cache groups (vLLM's hybrid KV cache manager).

Scheduler role: vLLM's own ``Scheduler`` with a two-group ``KVCacheConfig`` (a sliding
window group and a full-attention group, as Gemma3 splits its layers) drives the
connector; each step's model output is written here with the worker's report. The
store behind the lookups is a set of group-tagged ids: the blocks a step's plan dumped
are added to it after the step. Worker role: two groups of layers over one allocation,
a real posix store; a dump and an async load move each group's bytes under its own ids,
and a failed load is reported per request, never per block.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import vllm_scheduler

from kvfabric.harness.engine import kvfabric_transfer_config, vllm_problem
from kvfabric.ucm_layer import hashing
from kvfabric.ucm_layer.connector.config import ConnectorConfig
from kvfabric.ucm_layer.connector.plan import StepPlan, Transfer
from kvfabric.ucm_layer.connector.worker import WorkerSide

BS = 16
WINDOW = 32  # tokens: a prefix of H blocks needs the sliding group's blocks of [H*BS-31, H*BS)
NUM_BLOCKS = 96
PROMPT = 5 * BS + 3  # 5 full blocks can load; the 6th holds the last prompt token
SLIDING, FULL = 0, 1

needs_vllm = pytest.mark.skipif(bool(vllm_problem()), reason=vllm_problem() or "")


class GroupLookups:
    """A store's lookups as a set of group-tagged ids (``lookup_present``'s seam)."""

    def __init__(self) -> None:
        self.ids: set[bytes] = set()

    def add(self, ids: np.ndarray, group: int) -> None:
        self.ids.update(bytes(r) for r in hashing.tag(ids, 0, group))

    def drop(self, ids: np.ndarray, group: int) -> None:
        self.ids.difference_update(bytes(r) for r in hashing.tag(ids, 0, group))

    def __call__(self, ids: np.ndarray, group: int) -> np.ndarray:
        return np.array([bytes(r) in self.ids for r in hashing.tag(ids, 0, group)], bool)


@pytest.fixture(scope="module")
def model_dir() -> str:
    from kvfabric.harness.models import tiny_hybrid

    return str(tiny_hybrid())


def _scheduler(model_dir: str, store_dir: str):
    """vLLM's scheduler with the connector and a sliding-window + full-attention config."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    sliding = SlidingWindowSpec(
        block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=WINDOW
    )
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    sched = vllm_scheduler.scheduler(
        model_dir,
        kvfabric_transfer_config("posix", store_dir),
        [(layers[0::2], sliding), (layers[1::2], full)],
        block_size=BS,
        num_blocks=NUM_BLOCKS,
    )
    vc = sched.vllm_config
    store = GroupLookups()
    sched.connector.scheduler._lookup_present = store  # the seam SchedulerSide takes
    return vc, sched, store


def _request(rid: str, tokens: list[int], max_tokens: int = 2):
    return vllm_scheduler.request(rid, tokens, BS, max_tokens)


def _step(sched, store, *, sending=None, recving=None, failed=None):
    """One engine step with the worker's report; the plan's dumps count as stored."""
    plan, out, _ = vllm_scheduler.step(sched, sending=sending, recving=recving, failed=failed)
    for t in plan.dumps:
        store.add(t.ids, t.group)
    return plan, out


def _by_group(transfers, rid):
    return {t.group: t for t in transfers if t.req_id == rid}


def _cold(sched, store, prompt):
    """A first request computes the prompt; returns its dumps by group."""
    sched.add_request(_request("cold", prompt, max_tokens=1))
    plan, _ = _step(sched, store)
    dumps = _by_group(plan.dumps, "cold")
    _step(sched, store, sending={"cold"})
    return dumps


@needs_vllm
def test_the_hybrid_manager_stays_on_and_each_group_dumps_its_blocks(model_dir, tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    vc, sched, store = _scheduler(model_dir, str(tmp_path))
    assert supports_hma(sched.connector)
    assert vc.scheduler_config.disable_hybrid_kv_cache_manager is False
    prompt = list(range(100, 100 + PROMPT))
    sched.add_request(_request("cold", prompt, max_tokens=1))
    plan, out = _step(sched, store)
    dumps = _by_group(plan.dumps, "cold")
    (new,) = out.scheduled_new_reqs  # the blocks of the step (vLLM nulls those behind the window after it)
    blocks = new.block_ids
    assert [list(dumps[g].blocks) for g in (SLIDING, FULL)] == [list(blocks[g][:5]) for g in (0, 1)]
    assert dumps[SLIDING].transient and not dumps[FULL].transient
    assert np.array_equal(dumps[SLIDING].ids, dumps[FULL].ids)  # base ids; tagged per group
    # finished with dumps in flight: vLLM keeps every group's blocks until they are released
    assert "cold" in sched.requests
    _step(sched, store, sending={"cold"})
    assert "cold" not in sched.requests


@needs_vllm
def test_a_hit_loads_the_full_groups_prefix_and_the_sliding_window_asynchronously(model_dir, tmp_path):
    """A prefix of 5 blocks (80 tokens) needs the full group's blocks 0..4 and the sliding
    group's blocks 3..4 (tokens 49..79); vLLM allocates the null block for sliding blocks
    0..2, and the loads go into the blocks it allocated, which the request waits for."""
    from vllm.v1.request import RequestStatus

    _, sched, store = _scheduler(model_dir, str(tmp_path))
    prompt = list(range(300, 300 + PROMPT))
    stored = _cold(sched, store, prompt)[FULL].ids.copy()
    sched.add_request(_request("warm", prompt, max_tokens=2))
    plan, _ = _step(sched, store)
    assert not plan.loads
    loads = _by_group(plan.async_loads, "warm")
    assert sched.requests["warm"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    sliding, full = (list(b) for b in sched.kv_cache_manager.get_block_ids("warm"))
    assert sliding[:3] == [0, 0, 0] and 0 not in sliding[3:5]
    assert list(loads[FULL].blocks) == full[:5] and np.array_equal(loads[FULL].ids, stored)
    assert list(loads[SLIDING].blocks) == sliding[3:5] and np.array_equal(loads[SLIDING].ids, stored[3:5])
    _, out = _step(sched, store, recving={"warm"})
    plan, out = _step(sched, store)
    assert out.num_scheduled_tokens.get("warm") == PROMPT - 5 * BS  # the rest of the prompt
    assert not _by_group(plan.dumps, "warm")  # its blocks are stored already


@needs_vllm
def test_a_missing_sliding_block_shortens_the_hit_to_a_prefix_whose_window_is_stored(model_dir, tmp_path):
    """Without the sliding group's block 4, 5 blocks do not hit; 4 blocks (64 tokens) need
    its blocks 2..3 only, which are stored: the hit is 64 tokens."""
    _, sched, store = _scheduler(model_dir, str(tmp_path))
    prompt = list(range(500, 500 + PROMPT))
    stored = _cold(sched, store, prompt)[FULL].ids.copy()
    store.drop(stored[4:5], SLIDING)
    sched.add_request(_request("warm", prompt, max_tokens=2))
    plan, _ = _step(sched, store)
    loads = _by_group(plan.async_loads, "warm")
    sliding, full = (list(b) for b in sched.kv_cache_manager.get_block_ids("warm"))
    assert list(loads[FULL].blocks) == full[:4]
    assert np.array_equal(loads[SLIDING].ids, stored[2:4]) and list(loads[SLIDING].blocks) == sliding[2:4]
    store.drop(stored[0:1], FULL)  # no full-attention block 0: nothing hits
    sched.add_request(_request("none", prompt, max_tokens=2))
    plan, _ = _step(sched, store, recving={"warm"})
    assert not _by_group(plan.async_loads, "none")


@needs_vllm
def test_a_failed_async_load_is_recomputed_per_request_and_not_claimed_again(model_dir, tmp_path):
    """The worker reports the request in ``failed_recving`` (never block ids, which vLLM
    refuses with several groups): vLLM recomputes it from scratch, the connector does not
    claim the failed blocks again, and dumps them again once recomputed."""
    _, sched, store = _scheduler(model_dir, str(tmp_path))
    prompt = list(range(700, 700 + PROMPT))
    stored = _cold(sched, store, prompt)[FULL].ids.copy()
    sched.add_request(_request("warm", prompt, max_tokens=2))
    plan, _ = _step(sched, store)
    assert _by_group(plan.async_loads, "warm")
    _step(sched, store, failed={"warm"})
    plan, out = _step(sched, store)
    assert not plan.async_loads and out.num_scheduled_tokens.get("warm") == PROMPT
    assert "warm" in plan.repaired
    dumps = _by_group(plan.dumps, "warm")
    assert np.array_equal(dumps[FULL].ids, stored) and np.array_equal(dumps[SLIDING].ids, stored)


@needs_vllm
def test_groups_kvfabric_cannot_serve_and_layerwise_are_refused_with_the_fix():
    import dataclasses

    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from kvfabric.ucm_layer.connector import compat
    from kvfabric.ucm_layer.connector.connector import check_engine, check_groups

    kw = {"num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    full = FullAttentionSpec(block_size=BS, **kw)

    def config(*specs):
        groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)

    sliding = SlidingWindowSpec(block_size=BS, sliding_window=WINDOW, **kw)
    assert compat.group_windows(config(sliding, full), BS) == ((WINDOW, None), "")
    chunked = ChunkedLocalAttentionSpec(block_size=BS, attention_chunk_size=64, **kw)
    windows, why = compat.group_windows(config(chunked, full), BS)
    assert windows == () and "ChunkedLocalAttentionSpec" in why
    info = compat.EngineInfo("m", "float32", BS, BS, 8, 1, False, True, True, {}, False)
    with pytest.raises(ValueError, match=r"ChunkedLocalAttentionSpec.*--disable-hybrid-kv-cache-manager"):
        check_engine(dataclasses.replace(info, group_problem=why))
    two = dataclasses.replace(info, group_windows=(WINDOW, None))
    check_engine(two)
    check_groups(two, ConnectorConfig(store="posix", layerwise=False))
    with pytest.raises(ValueError, match="layerwise=false"):
        check_groups(two, ConnectorConfig(store="posix", layerwise=True))


# ---------------------------------------------------------------------- worker role
NB = 12
GROUPS = (("l0", "l2"), ("l1", "l3"))


def _caches(seed: int) -> dict[str, torch.Tensor]:
    """Four layers over one allocation (the layers of both groups are views of it)."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(4, NB, 2, 8, 16, generator=g)
    return {f"l{i}": big[i] for i in range(4)}


def _worker(plat, tmp_path, fail: bool = False) -> WorkerSide:
    from kvfabric.ucm_layer.store.posix import PosixConfig, PosixStore

    def factory(layout):
        root = tmp_path / ("missing" if fail else "kv")
        return PosixStore(PosixConfig(dirs=(str(root),), io_threads=1), platform=plat, layout=layout)

    cfg = ConnectorConfig(store="posix", posix_path=str(tmp_path / "kv"), async_load=True)
    return WorkerSide(cfg, plat, factory, groups=GROUPS)


def _ids(n: int, salt: int = 0) -> np.ndarray:
    return hashing.untag(np.random.default_rng(salt).integers(0, 256, (n, 16), dtype=np.uint8))


def _wait_loads(w: WorkerSide, req_id: str) -> None:
    import time

    deadline = time.monotonic() + 10
    while req_id not in w.finished_loads():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_worker_dumps_and_loads_each_group_under_its_own_ids(plat, tmp_path):
    src = _caches(1)
    dst = {k: torch.zeros_like(v) for k, v in _caches(1).items()}
    a = _worker(plat, tmp_path)
    a.register(src, NB)
    ids = _ids(3)
    plan = StepPlan(
        dumps=[
            Transfer("r1", ids[1:], np.array([5, 6]), group=0, transient=True),
            Transfer("r1", ids, np.array([0, 1, 2]), group=1),
        ]
    )
    a.wait_for_save(plan)  # the sliding window's dump released its blocks on return
    a._reap(block=True)
    store = a.stores[0]  # both groups' stores keep their files in one directory
    assert store.lookup(hashing.tag(ids, 0, 1)).all()
    assert list(store.lookup(hashing.tag(ids, 0, 0))) == [False, True, True]
    b = _worker(plat, tmp_path)
    b.register(dst, NB)
    b.start_load(
        StepPlan(
            async_loads=[
                Transfer("r2", ids[1:], np.array([9, 10]), group=0),
                Transfer("r2", ids, np.array([3, 4, 7]), group=1),
            ]
        )
    )
    _wait_loads(b, "r2")
    assert b.failed_loads() == set() and b.failed_blocks() == set()
    for name in ("l0", "l2"):
        assert torch.equal(dst[name][9:11], src[name][5:7])
    for name in ("l1", "l3"):
        assert torch.equal(dst[name][[3, 4, 7]], src[name][0:3])
    a.close(), b.close()


def test_worker_reports_a_failed_load_per_request_never_per_block(plat, tmp_path):
    w = _worker(plat, tmp_path, fail=True)
    w.register(_caches(2), NB)
    ids = _ids(2, 5)
    w.start_load(
        StepPlan(
            async_loads=[
                Transfer("r", ids, np.array([1, 2]), group=0),
                Transfer("r", ids, np.array([3, 4]), group=1),
            ]
        )
    )
    _wait_loads(w, "r")
    assert w.failed_loads() == {"r"}
    assert w.failed_loads() == set()  # once
    assert w.failed_blocks() == set()
    w.close()
