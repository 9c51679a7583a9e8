"""The connector's scheduler role driven by vLLM's own ``Scheduler`` (as vLLM's connector
unit tests drive theirs): no model runs; each step's model output is written here, with
the worker's report (``invalid_block_ids``, ``finished_sending``) in it.

The store behind the scheduler's lookups is a set of ids: the blocks a step's plan dumped
are added to it after the step, as a worker whose dumps succeeded would. Scenarios: a
load that fails for one block is recomputed by vLLM and that block (with those after it)
is in the next step's dump plan, under the ids it was looked up by; and vLLM's
``make_stats`` carries the connector's counters, which vLLM's logging path turns back
into kvfabric's stats object.
"""

from __future__ import annotations

import numpy as np
import pytest
import vllm_scheduler
from store_lookups import StoreLookups

from kvfabric.harness.engine import kvfabric_transfer_config, vllm_problem

pytestmark = pytest.mark.skipif(bool(vllm_problem()), reason=vllm_problem() or "")

BS = 16
NUM_BLOCKS = 64
PROMPT = 5 * BS + 3  # 5 full blocks can load; the 6th holds the last prompt token


@pytest.fixture(scope="module")
def model_dir() -> str:
    from kvfabric.harness.models import tiny_llama

    return str(tiny_llama())


def _scheduler(
    model_dir: str,
    store_dir: str,
    prefix_caching: bool = False,
    store: StoreLookups | None = None,
    role: str = "kv_both",
    **extra,
):
    """vLLM's scheduler with the connector; ``extra`` are kvfabric config keys (synchronous
    loads unless it says otherwise)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    transfer = {
        **kvfabric_transfer_config("posix", store_dir, **{"async_load": False, **extra}),
        "kv_role": role,
    }
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    sched = vllm_scheduler.scheduler(
        model_dir,
        transfer,
        [(layers, spec)],
        block_size=BS,
        num_blocks=NUM_BLOCKS,
        prefix_caching=prefix_caching,
    )
    store = store if store is not None else StoreLookups()
    sched.connector.scheduler._lookup_prefix = store  # the seam SchedulerSide takes
    return sched, store


def _request(rid: str, tokens: list[int], max_tokens: int = 2, params: dict | None = None):
    return vllm_scheduler.request(rid, tokens, BS, max_tokens, params)


def _step(
    sched,
    store,
    *,
    invalid: set[int] | None = None,
    sending: set[str] | None = None,
    recving: set[str] | None = None,
):
    """One engine step (``vllm_scheduler.step``); the plan's dumps count as stored.
    Returns (plan, outputs)."""
    plan, _, outputs = vllm_scheduler.step(sched, invalid=invalid, sending=sending, recving=recving)
    for t in plan.dumps:
        store.add(t.ids)
    return plan, outputs


def _blocks_of(sched, rid: str) -> list[int]:
    (blocks,) = sched.kv_cache_manager.get_block_ids(rid)
    return list(blocks)


def test_a_failed_block_is_recomputed_and_in_the_next_steps_dump_plan(model_dir, tmp_path):
    sched, store = _scheduler(model_dir, str(tmp_path))
    prompt = list(range(100, 100 + PROMPT))
    sched.add_request(_request("cold", prompt, max_tokens=1))
    plan, _ = _step(sched, store)
    assert not plan.loads and [t.blocks.size for t in plan.dumps] == [5]
    stored_ids = plan.dumps[0].ids.copy()
    plan, _ = _step(sched, store, sending={"cold"})  # the worker released the finished request
    assert plan.finished == {"cold"} or not sched.requests

    sched.add_request(_request("warm", prompt, max_tokens=4))
    out = sched.schedule()  # scheduled by hand: the report names this request's blocks
    plan = out.kv_connector_metadata.plan
    assert [t.blocks.size for t in plan.loads] == [5] and not plan.dumps
    assert np.array_equal(plan.loads[0].ids, stored_ids)
    blocks = _blocks_of(sched, "warm")
    assert list(plan.loads[0].blocks) == blocks[:5]
    assert out.num_scheduled_tokens["warm"] == PROMPT - 5 * BS

    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    mro = ModelRunnerOutput(
        req_ids=["warm"],
        req_id_to_index={"warm": 0},
        sampled_token_ids=[[7]],
        kv_connector_output=KVConnectorOutput(invalid_block_ids={blocks[2]}),
    )
    sched.update_from_output(out, mro)
    req = sched.requests["warm"]
    assert req.num_computed_tokens == 2 * BS  # vLLM recomputes from the failed block
    assert not req.output_token_ids  # the step's token was thrown away

    plan, _ = _step(sched, store)  # the recompute
    assert not plan.loads and plan.repaired == {"warm"}
    assert [list(t.blocks) for t in plan.dumps] == [blocks[2:5]]
    assert np.array_equal(plan.dumps[0].ids, stored_ids[2:5])  # dumped again, same ids
    assert sched.connector.scheduler.stats.totals["repair_blocks"] == 3

    # a third request with the same prompt loads every full block again
    sched.add_request(_request("again", prompt, max_tokens=1))
    while "again" not in sched.requests or sched.requests["again"].num_computed_tokens == 0:
        plan, _ = _step(sched, store)
        if any(t.req_id == "again" for t in plan.loads):
            break
    assert [t.blocks.size for t in plan.loads if t.req_id == "again"] == [5]


def test_make_stats_carries_the_connectors_counters(model_dir, tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    from kvfabric.ucm_layer.connector.connector import KVFabricStats

    sched, store = _scheduler(model_dir, str(tmp_path))
    prompt = list(range(300, 300 + PROMPT))
    sched.add_request(_request("s1", prompt, max_tokens=1))
    _, outputs = _step(sched, store)
    stats = next(o.scheduler_stats for o in outputs.values() if o.scheduler_stats is not None)
    data = stats.kv_connector_stats
    assert data and data["lookups"] == 1 and data["requested_tokens"] == PROMPT
    # vLLM's logging path: build_kv_connector_stats -> aggregate -> reduce
    logging_path = KVConnectorLogging(sched.vllm_config.kv_transfer_config)
    logging_path.observe(data)
    acc = logging_path.transfer_stats_accumulator
    assert isinstance(acc, KVFabricStats) and not acc.is_empty()
    assert acc.reduce()["lookups"] == 1
    assert sched.make_stats() is not None

    # vLLM's Prometheus path: build_prom_metrics -> observe -> /metrics samples
    from prometheus_client import REGISTRY
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    unregister_vllm_metrics()
    try:
        prom = KVConnectorProm(sched.vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})
        assert prom.prom_metrics is not None
        prom.observe(data, 0)
        labels = {"model_name": "tiny", "engine": "0"}
        assert REGISTRY.get_sample_value("vllm:kvfabric_lookups_total", labels) == 1
        assert REGISTRY.get_sample_value("vllm:kvfabric_requested_tokens_total", labels) == PROMPT
    finally:
        unregister_vllm_metrics()


def test_a_request_sharing_a_failed_block_through_the_prefix_cache_is_set_back_too(model_dir, tmp_path):
    """vLLM's prefix cache lets a second request start on the blocks the first one loads in
    the same step: both read the failed block and are named readers and then repaired;
    only the one vLLM makes recompute it dumps it again."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    cold, store = _scheduler(model_dir, str(tmp_path))
    prompt = list(range(500, 500 + PROMPT))
    cold.add_request(_request("cold", prompt, max_tokens=1))
    _step(cold, store)
    sched, _ = _scheduler(model_dir, str(tmp_path), prefix_caching=True, store=store)
    sched.add_request(_request("a", prompt, max_tokens=4))
    sched.add_request(_request("b", prompt, max_tokens=4))
    out = sched.schedule()
    plan = out.kv_connector_metadata.plan
    blocks = _blocks_of(sched, "a")
    assert [t.req_id for t in plan.loads] == ["a"] and _blocks_of(sched, "b")[:5] == blocks[:5]
    assert plan.readers == {"a": set(blocks[:5]), "b": set(blocks[:5])}
    ids = list(out.num_scheduled_tokens)
    sched.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=KVConnectorOutput(invalid_block_ids={blocks[1]}),
        ),
    )
    side = sched.connector.scheduler
    # vLLM recomputes the shared block in "a": "a" is set back to it, "b" only to its first
    # block of its own (the ones after the shared prefix, whose dumps the workers skipped)
    assert side._reqs["a"].stored == 1 and side._reqs["b"].stored == 5
    plan, _ = _step(sched, store)
    assert plan.repaired == {"a", "b"}  # both read it: the workers dump them again
    assert [list(t.blocks) for t in plan.dumps if t.req_id == "a"] == [blocks[1:5]]
    assert not [t for t in plan.dumps if t.req_id == "b" and set(t.blocks.tolist()) & set(blocks[:5])]


def test_an_async_load_keeps_its_request_waiting_and_a_failed_block_is_recomputed(model_dir, tmp_path):
    """``async_load``: the load is planned (``async_loads``) while the request waits in
    vLLM; another request keeps being scheduled meanwhile; the worker's report of the
    finished load with one failed block makes vLLM compute from that block, and the next
    plan dumps it (and those after it) again."""
    sched, store = _scheduler(model_dir, str(tmp_path), async_load=True)
    prompt = list(range(700, 700 + PROMPT))
    sched.add_request(_request("cold", prompt, max_tokens=1))
    plan, _ = _step(sched, store)
    stored_ids = plan.dumps[0].ids.copy()
    _step(sched, store, sending={"cold"})

    sched.add_request(_request("other", list(range(2000, 2000 + BS + 2)), max_tokens=8))
    _step(sched, store)  # "other" is running
    sched.add_request(_request("warm", prompt, max_tokens=4))
    plan, _ = _step(sched, store)
    assert not plan.loads and [t.req_id for t in plan.async_loads] == ["warm"]
    assert np.array_equal(plan.async_loads[0].ids, stored_ids)
    blocks = list(plan.async_loads[0].blocks)
    from vllm.v1.request import RequestStatus

    assert sched.requests["warm"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    out = sched.schedule()  # the load is in flight: only "other" steps
    assert set(out.num_scheduled_tokens) == {"other"}
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    sched.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=["other"],
            req_id_to_index={"other": 0},
            sampled_token_ids=[[7]],
            kv_connector_output=KVConnectorOutput(finished_recving={"warm"}, invalid_block_ids={blocks[3]}),
        ),
    )
    plan, _ = _step(sched, store)  # "warm" computes from its failed block
    assert plan.repaired == {"warm"}
    assert [list(t.blocks) for t in plan.dumps if t.req_id == "warm"] == [blocks[3:5]]
    assert np.array_equal(next(t for t in plan.dumps if t.req_id == "warm").ids, stored_ids[3:5])


def test_a_pd_consumer_waits_for_the_announced_blocks_then_loads_them(model_dir, tmp_path):
    """P/D: the producer's ``request_finished`` hands its decode engine ``kv_transfer_params``
    (``do_remote_prefill`` and, under ``kvfabric``, the blocks it stored and the fingerprint
    of their ids); the consumer is not scheduled while the store lacks them (vLLM asks again
    each step), and loads every one once they are visible."""
    prompt = list(range(900, 900 + PROMPT))
    prod, store = _scheduler(model_dir, str(tmp_path), role="kv_producer")
    prod.add_request(_request("p", prompt, max_tokens=1, params={"do_remote_decode": True}))
    out = prod.schedule()
    plan = out.kv_connector_metadata.plan
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    outputs = prod.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=["p"],
            req_id_to_index={"p": 0},
            sampled_token_ids=[[7]],
            kv_connector_output=KVConnectorOutput(),
        ),
    )
    params = next(o for eo in outputs.values() for o in eo.outputs if o.request_id == "p").kv_transfer_params
    assert params["do_remote_prefill"] is True and params["kvfabric"]["blocks"] == 5
    assert params["kvfabric"]["fingerprint"] == prod.connector.scheduler.fingerprint

    cons, _ = _scheduler(model_dir, str(tmp_path), store=store, role="kv_consumer", async_load=True)
    cons.add_request(_request("d", prompt, max_tokens=4, params=params))
    for _ in range(3):  # the producer's dumps are not visible yet
        p2, _ = _step(cons, store)
        assert not p2.async_loads and "d" not in cons.running
    import time

    store.add(plan.dumps[0].ids[:3])  # three of five visible: still waiting
    time.sleep(0.01)  # a waiting consumer asks the store at most every 5 ms
    p2, _ = _step(cons, store)
    assert not p2.async_loads
    store.add(plan.dumps[0].ids)
    time.sleep(0.01)
    p2, _ = _step(cons, store)
    assert [(t.req_id, t.blocks.size) for t in p2.async_loads] == [("d", 5)]


def test_a_pd_consumer_stops_waiting_after_pd_wait_s_and_uses_what_is_there(model_dir, tmp_path):
    import time

    prompt = list(range(1100, 1100 + PROMPT))
    cons, store = _scheduler(model_dir, str(tmp_path), role="kv_consumer", async_load=True, pd_wait_s=0.3)
    from kvfabric.ucm_layer import hashing

    side = cons.connector.scheduler
    params = {"do_remote_prefill": True, "kvfabric": {"blocks": 5, "fingerprint": side.fingerprint}}
    cons.add_request(_request("d", prompt, max_tokens=2, params=params))
    plan, _ = _step(cons, store)
    assert not plan.async_loads and not plan.dumps
    st = side._reqs["d"]
    store.add(hashing.untag(st.ids[:2]))  # only two blocks ever arrive
    time.sleep(0.35)
    plan, _ = _step(cons, store)
    assert [(t.req_id, t.blocks.size) for t in plan.async_loads] == [("d", 2)]
    # a hand-off from an engine with other block ids is not waited for
    other = {"do_remote_prefill": True, "kvfabric": {"blocks": 5, "fingerprint": "0" * 16}}
    cons.add_request(_request("x", list(range(1300, 1300 + PROMPT)), max_tokens=4, params=other))
    plan, _ = _step(cons, store)
    assert "x" in {r.request_id for r in cons.running}  # scheduled at once, computed here
    assert not [t for t in plan.async_loads if t.req_id == "x"]


def test_an_async_load_whose_every_block_failed_is_computed_not_loaded_again(model_dir, tmp_path):
    """vLLM frees a request whose async load failed from its first block and looks it up
    again: the connector must not claim the failed blocks a second time (the store may
    still list them), or the request would load and fail for ever."""
    sched, store = _scheduler(model_dir, str(tmp_path), async_load=True)
    prompt = list(range(1500, 1500 + PROMPT))
    sched.add_request(_request("cold", prompt, max_tokens=1))
    _step(sched, store)
    _step(sched, store, sending={"cold"})
    sched.add_request(_request("warm", prompt, max_tokens=2))
    plan, _ = _step(sched, store)
    blocks = set(plan.async_loads[0].blocks.tolist())
    plan, _ = _step(sched, store, recving={"warm"}, invalid=blocks)  # every block failed
    for _ in range(4):
        assert not plan.async_loads and not plan.loads
        if any(t.req_id == "warm" for t in plan.dumps):
            break
        plan, _ = _step(sched, store)
    assert [t.blocks.size for t in plan.dumps if t.req_id == "warm"] == [5]  # computed, stored again
