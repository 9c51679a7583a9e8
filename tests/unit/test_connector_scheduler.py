"""The scheduler role on plain values: lookups, load plans, dump plans, delayed frees."""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pytest
from store_lookups import StoreLookups

from kvfabric.ucm_layer.connector.scheduler import SchedulerSide
from kvfabric.ucm_layer.connector.views import CachedReq, NewReq, ReqView

BS = 4


def _ids_from_hashes(hashes, parent):
    return np.array(
        [np.frombuffer(hashlib.blake2b(bytes(h), digest_size=16).digest(), np.uint8) for h in hashes],
        np.uint8,
    ).reshape(-1, 16)


def _req(rid: str, ntok: int) -> ReqView:
    hashes = [f"{rid[0]}-{i}".encode() for i in range(ntok // BS)]  # same prefix for same first letter
    return ReqView(rid, hashes, ntok, ntok)


@pytest.fixture
def side():
    store = StoreLookups()
    return SchedulerSide(BS, _ids_from_hashes, store), store


def test_first_request_dumps_every_full_block_it_computes(side):
    s, _ = side
    r = _req("a1", 18)  # 4 full blocks + 2 tokens
    assert s.num_new_matched_tokens(r, 0) == 0
    s.after_alloc(r, [10, 11, 12, 13, 14], 0)
    plan = s.build_plan([NewReq("a1", [10, 11, 12, 13, 14], 0)], [], {"a1": 18})
    assert not plan.loads
    assert [list(t.blocks) for t in plan.dumps] == [[10, 11, 12, 13]]
    assert s.request_finished("a1") is True
    plan2 = s.build_plan([], [], {})
    assert plan2.finished == {"a1"}


def test_second_request_loads_beyond_local_hits_and_never_the_last_token(side):
    s, store = side
    store.add(_ids_from_hashes([f"a-{i}".encode() for i in range(4)], None))
    r = _req("a2", 16)  # exactly 4 blocks: the 4th holds the last token, never claimed
    assert s.num_new_matched_tokens(r, 4) == 2 * BS  # block 0 local, 1..2 from the store
    calls = store.calls
    assert s.num_new_matched_tokens(r, 4) == 2 * BS  # idempotent, no new lookup
    assert store.calls == calls
    s.after_alloc(r, [7, 8, 9, 20], 2 * BS)
    plan = s.build_plan([NewReq("a2", [7, 8, 9, 20], 3 * BS)], [], {"a2": 4})
    assert len(plan.loads) == 1 and list(plan.loads[0].blocks) == [8, 9]
    assert plan.loads[0].ids.shape == (2, 16)
    assert [list(t.blocks) for t in plan.dumps] == [[20]]  # only the block it computes
    assert s.request_finished("a2") is True


def test_a_store_that_does_not_answer_is_a_miss_logged_once(side, caplog):
    s, store = side
    store.down = True
    with caplog.at_level(logging.WARNING, logger="kvfabric.connector"):
        assert s.num_new_matched_tokens(_req("b1", 20), 0) == 0
        assert s.num_new_matched_tokens(_req("c1", 20), 0) == 0
    assert len([r for r in caplog.records if "lookup failed" in r.message]) == 1


def test_decode_blocks_are_dumped_as_they_fill_and_resume_resets(side):
    s, _ = side
    r = _req("d1", 6)
    s.num_new_matched_tokens(r, 0)
    s.after_alloc(r, [1, 2], 0)
    plan = s.build_plan([NewReq("d1", [1, 2], 0)], [], {"d1": 6})
    assert [list(t.blocks) for t in plan.dumps] == [[1]]
    # decode: tokens 6, 7 arrive; block 2 fills after token 7 is computed
    s._reqs["d1"].view = ReqView("d1", [b"d-0", b"d-1"], 8, 6)
    plan = s.build_plan([], [CachedReq("d1", None, False, 6)], {"d1": 1})
    assert not plan.dumps
    plan = s.build_plan([], [CachedReq("d1", [3], False, 7)], {"d1": 1})
    assert [list(t.blocks) for t in plan.dumps] == [[2]]
    plan = s.build_plan([], [CachedReq("d1", [5, 6, 7], True, 0)], {"d1": 8}, {"x"})
    assert plan.preempted == {"x"}
    assert [list(t.blocks) for t in plan.dumps] == [[5, 6]]


def test_requests_without_dumps_are_freed_at_once_and_roles_can_be_off():
    store = StoreLookups()
    s = SchedulerSide(BS, _ids_from_hashes, store, load=False, save=False)
    r = _req("e1", 12)
    assert s.num_new_matched_tokens(r, 0) == 0 and store.calls == 0
    s.after_alloc(r, [1, 2, 3], 0)
    assert not s.build_plan([NewReq("e1", [1, 2, 3], 0)], [], {"e1": 12}).dumps
    assert s.request_finished("e1") is False
    assert s.request_finished("never-seen") is False


def test_accepting_more_than_the_lookup_found_is_an_error(side):
    s, _ = side
    r = _req("f1", 12)
    s.num_new_matched_tokens(r, 0)
    with pytest.raises(ValueError, match="external tokens"):
        s.after_alloc(r, [1, 2, 3], BS)


def test_a_failed_load_sets_the_stored_watermark_back_so_the_recompute_is_dumped(side):
    s, store = side
    ids = _ids_from_hashes([f"g-{i}".encode() for i in range(4)], None)
    store.add(ids)
    r = _req("g1", 18)  # 4 full blocks in the store, 2 tokens beyond
    assert s.num_new_matched_tokens(r, 0) == 4 * BS
    s.after_alloc(r, [30, 31, 32, 33, 34], 4 * BS)
    plan = s.build_plan([NewReq("g1", [30, 31, 32, 33, 34], 4 * BS)], [], {"g1": 2})
    assert [list(t.blocks) for t in plan.loads] == [[30, 31, 32, 33]] and not plan.dumps
    assert plan.readers == {"g1": {30, 31, 32, 33}}  # its own loaded blocks
    # the load of engine block 32 failed: vLLM recomputes from block 2 on
    assert s.load_failed({32, 999}) == 2
    assert s.stats.totals["repair_blocks"] == 2
    plan = s.build_plan([], [CachedReq("g1", None, False, 2 * BS)], {"g1": 18 - 2 * BS})
    assert not plan.loads
    assert [list(t.blocks) for t in plan.dumps] == [[32, 33]]
    assert np.array_equal(plan.dumps[0].ids, ids[2:4])  # the same blocks, under the same ids
    assert s.load_failed(set()) == 0 and s.load_failed({77}) == 0  # nothing of ours: no change


def test_a_request_starting_on_blocks_another_one_loads_this_step_is_a_reader(side):
    s, store = side
    store.add(_ids_from_hashes([f"h-{i}".encode() for i in range(2)], None))
    a, b = _req("h1", 10), _req("h2", 10)  # same prefix
    assert s.num_new_matched_tokens(a, 0) == 2 * BS
    s.after_alloc(a, [40, 41, 42], 2 * BS)
    s.num_new_matched_tokens(b, 2 * BS)  # vLLM's prefix cache shares a's blocks 40, 41
    s.after_alloc(b, [40, 41, 43], 0)
    plan = s.build_plan(
        [NewReq("h1", [40, 41, 42], 2 * BS), NewReq("h2", [40, 41, 43], 2 * BS), NewReq("h3", [9], 0)],
        [],
        {"h1": 2, "h2": 2, "h3": 1},
    )
    assert plan.readers == {"h1": {40, 41}, "h2": {40, 41}}
    assert s.build_plan([], [], {}).readers == {}  # no loads, no readers


def test_lookup_outcomes_count_a_prompt_below_one_block_apart_from_misses(side):
    s, store = side
    store.add(_ids_from_hashes([f"h-{i}".encode() for i in range(3)], None))
    s.num_new_matched_tokens(_req("h1", 14), 0)  # 3 full blocks held, the 4th has the last token
    s.num_new_matched_tokens(_req("m1", 12), 0)  # 3 full blocks, none held: a miss
    s.num_new_matched_tokens(ReqView("b1", [], 3, 3), 0)  # 3 tokens: no full block, not a miss
    t = s.stats.totals
    assert (t["lookups"], t["lookup_hits"], t["lookup_misses"], t["lookup_below_block"]) == (3, 1, 1, 1)
    assert t["external_hit_tokens"] == 3 * BS
