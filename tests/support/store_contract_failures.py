"""The store conformance suite, part 2: failures. A killed writer, cancellation, timeouts,
failed copies and ``close`` with work outstanding. Imported by ``store_contract``."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
from store_faults import blocked_event, child_dump_forever, clear_faults, fail_copies
from stores import LAYOUT, PERSISTENT, Blocks, block_bytes, build_store, lowest, random_ids

from kvfabric.status import Handle
from kvfabric.ucm_layer.store.base import BlockStatus

OK, FAILED = int(BlockStatus.OK), int(BlockStatus.FAILED)
CANCELLED, TIMEOUT = int(BlockStatus.CANCELLED), int(BlockStatus.TIMEOUT)
N = 16


def dump_all(store, ids, blocks, after=None):
    return store.wait(store.dump(ids, 0, blocks.addrs, after=after))


def load_all(store, ids, blocks):
    return store.wait(store.load(ids, 0, blocks.addrs))


# ---------------------------------------------------------------------------- a writer killed
def _spawn_writer(spec, root, stall, seed, platform):
    ctx = mp.get_context("spawn")
    env = {k: v for k, v in os.environ.items() if k.startswith("KVFABRIC_")}
    args = (spec, str(root), env, seed, 8, stall, platform)
    proc = ctx.Process(target=child_dump_forever, args=args, daemon=True)
    proc.start()
    return proc


def _wait_for(path, proc, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.is_alive(), "the writer died on its own"
        assert time.monotonic() < deadline, f"the writer never reached {path}"
        time.sleep(0.01)


def _verify_visible(store, plat, ids):
    """Every block ``lookup`` shows loads bit-exact; returns how many were visible."""
    mask = store.lookup(ids)
    vis = ids[mask]
    if len(vis):
        dst = Blocks(plat, LAYOUT, len(vis))
        assert (load_all(store, vis, dst) == OK).all()
        assert np.array_equal(dst.read(), block_bytes(vis, LAYOUT.shard_bytes))
        dst.free()
    return int(mask.sum())


def test_writer_killed_mid_dump_leaves_no_torn_block(store_spec, tmp_path, plat, spec):
    if lowest(store_spec) not in PERSISTENT:
        pytest.skip(f"{store_spec!r} keeps blocks in the writer's own memory: they die with it")
    if spec.endswith("-fake") and store_spec.startswith("cache|"):
        pytest.skip("the cache tier adds nothing to a killed writer's commit; its lowest tier runs here")
    # deterministic: the writer stalls in the middle of a block file, then is killed
    proc = _spawn_writer(store_spec, tmp_path, stall=True, seed=100, platform=spec)
    try:
        _wait_for(tmp_path / "stalled", proc)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    s = build_store(store_spec, tmp_path, plat)
    try:
        assert _verify_visible(s, plat, random_ids(8, 100)) < 8  # the stalled block never shows
        # and killed at arbitrary moments, round after round
        for k in range(3):
            (tmp_path / "progress").unlink(missing_ok=True)
            proc = _spawn_writer(store_spec, tmp_path, stall=False, seed=1000 * (k + 1), platform=spec)
            try:
                _wait_for(tmp_path / "progress", proc)
                time.sleep(0.01 + 0.03 * k)
            finally:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(30)
            rounds = int((tmp_path / "progress").read_text() or 0) + 2
            seen = sum(_verify_visible(s, plat, random_ids(8, 1000 * (k + 1) + r)) for r in range(rounds))
            assert seen >= 8  # at least the first round completed before the kill
    finally:
        s.close()


# ---------------------------------------------------------------------------- cancel, timeout
def _blocked_dump(store, plat, seed, seconds=1.5):
    """``(ids, src, stream, task)``: a dump of N blocks held back by an event that completes
    only after ``seconds`` (once ``stream`` is synchronized)."""
    ids = random_ids(N, seed)
    src = Blocks(plat, LAYOUT, N)
    src.write(block_bytes(ids, LAYOUT.shard_bytes))
    s, ev = blocked_event(plat, seconds)
    return ids, src, s, store.dump(ids, 0, src.addrs, after=ev)


def test_cancelled_dump_leaves_nothing_visible(store, plat):
    ids, _src, s, t = _blocked_dump(store, plat, 8)
    assert not store.check(t)
    store.cancel(t)
    assert store.check(t)
    assert (store.wait(t) == CANCELLED).all()
    s.synchronize()
    time.sleep(0.1)
    assert not store.lookup(ids).any()


def _stored(store, plat, seed, n=64):
    """``(ids, data, dst)``: ``n`` blocks dumped into ``store`` and an untouched destination."""
    ids = random_ids(n, seed)
    data = block_bytes(ids, LAYOUT.shard_bytes)
    src, dst = Blocks(plat, LAYOUT, n), Blocks(plat, LAYOUT, n)
    src.write(data)
    assert (dump_all(store, ids, src) == OK).all()
    return ids, data, dst


def _only_ok_blocks_touched(st, dst, data, stopped):
    """Every block is ``OK`` (its bytes arrived) or ``stopped`` (its destination untouched)."""
    assert set(np.unique(st)) <= {OK, stopped}
    got = dst.read()
    for i in range(len(data)):
        assert np.array_equal(got[i], data[i]) if st[i] == OK else dst.untouched(i)


def test_cancelled_load_touches_nothing_it_did_not_report(store, plat):
    ids, data, dst = _stored(store, plat, 9)
    t = store.load(ids, 0, dst.addrs)
    store.cancel(t)
    _only_ok_blocks_touched(store.wait(t), dst, data, CANCELLED)


def test_dump_timeout_cancels_cleanly(store, plat):
    ids, src, s, t = _blocked_dump(store, plat, 10)
    assert (store.wait(t, timeout=0.1) == TIMEOUT).all()
    s.synchronize()
    time.sleep(0.1)
    assert not store.lookup(ids).any()
    # the store still works afterwards
    assert (dump_all(store, ids, src) == OK).all()


def test_load_timeout_reports_and_touches_only_finished_blocks(store, plat):
    ids, data, dst = _stored(store, plat, 11)
    st = store.wait(store.load(ids, 0, dst.addrs), timeout=0)
    time.sleep(0.2)  # whatever was still running has stopped by now
    _only_ok_blocks_touched(st, dst, data, TIMEOUT)


def test_failed_copies_are_per_block_failures(store, plat):
    ids = random_ids(8, 12)
    src, dst = Blocks(plat, LAYOUT, 8), Blocks(plat, LAYOUT, 8)
    src.write(block_bytes(ids, LAYOUT.shard_bytes))
    fail_copies(plat)
    st = dump_all(store, ids, src)
    clear_faults(plat)
    assert (st == FAILED).all()
    assert not store.lookup(ids).any()
    assert (dump_all(store, ids, src) == OK).all()
    fail_copies(plat)
    st = load_all(store, ids, dst)
    clear_faults(plat)
    assert (st == FAILED).all()


def test_close_finishes_or_cancels_outstanding_tasks(store_spec, tmp_path, plat, monkeypatch):
    from kvfabric.ucm_layer.store import common

    monkeypatch.setattr(common, "CLOSE_GRACE_S", 0.2)
    s = build_store(store_spec, tmp_path, plat)
    ids = random_ids(N, 15)
    src = Blocks(plat, LAYOUT, N)
    src.write(block_bytes(ids, LAYOUT.shard_bytes))
    done = s.dump(ids[:4], 0, src.addrs[:4])  # runs to completion
    stream, ev = blocked_event(plat, 1.0)
    stuck = s.dump(ids[4:], 0, src.addrs[4:], after=ev)  # waits on an event that is late
    s.close()
    assert (s.wait(done) == OK).all()
    assert (s.wait(stuck) == CANCELLED).all()
    stream.synchronize()
    if lowest(store_spec) in PERSISTENT:
        again = build_store(store_spec, tmp_path, plat)
        try:
            assert again.lookup(ids).tolist() == [True] * 4 + [False] * (N - 4)
        finally:
            again.close()


def test_task_is_a_handle_whose_timeout_leaves_it_waitable(store, plat):
    ids, _src, s, t = _blocked_dump(store, plat, 14, seconds=0.3)
    assert isinstance(t, Handle) and t.store is store and not t.check()
    with pytest.raises(TimeoutError):
        t.wait(0.02)
    assert not t.check()  # still running: the timeout changed nothing
    s.synchronize()
    assert (t.wait(30) == OK).all() and store.lookup(ids).all()
    with pytest.raises(ValueError, match="already waited"):
        t.wait()
    t2 = store.load(ids, 0, Blocks(plat, LAYOUT, N).addrs)
    t2.cancel()
    assert t2.check() and set(np.unique(t2.wait())) <= {OK, CANCELLED}
