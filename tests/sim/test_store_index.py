"""Indexes (``registry.create_index``): the metadata side of the shared stores, as a
scheduler in another process sees what the workers' stores wrote. An index answers like
the store, allocates no buffer, starts no thread and holds no data path; stores whose
blocks live in one process are refused with the reason."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
from pool_testing import Daemon
from stores import LAYOUT, build_store, config_for, dump_blocks, random_ids

from kvfabric.platform.sim import SimPlatform
from kvfabric.ucm_layer.store.base import Index, StoreLayout
from kvfabric.ucm_layer.store.index import PoolIndex, PosixIndex, UnsharedStore
from kvfabric.ucm_layer.store.registry import create_index, unshared_reason


@pytest.fixture
def plat():
    p = SimPlatform()
    yield p
    p.close()


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path, name="pool", dram="16MiB").start()  # the socket config_for names
    yield d
    d.stop()


def _present_first(store, plat, n_present: int, n: int, seed: int) -> np.ndarray:
    ids = random_ids(n, seed)
    assert (dump_blocks(store, plat, ids[:n_present]) == 0).all()
    return ids


@pytest.mark.parametrize("spec", ["posix", "cache|posix", "pool", "cache|pool"])
def test_an_index_sees_what_the_store_wrote_and_holds_no_data_path(spec, tmp_path, plat, request):
    if "pool" in spec:
        request.getfixturevalue("daemon")
    cfg = config_for(spec, tmp_path, LAYOUT)
    store = build_store(spec, tmp_path, plat)
    try:
        ids = _present_first(store, plat, 5, 8, seed=3)
        threads, buffers = threading.active_count(), len(plat.buffers())
        index = create_index(config=cfg, platform=plat, layout=LAYOUT)
        try:
            assert isinstance(index, Index) and isinstance(index, PoolIndex if "pool" in spec else PosixIndex)
            names = sorted(t.name for t in threading.enumerate())
            assert threading.active_count() == threads, names  # no copy threads
            assert len(plat.buffers()) == buffers  # no cache capacity, no bounce area, no window
            if isinstance(index, PoolIndex):
                assert index.client.metadata_only and index.client.fabric is None
                assert index.client.table is not None  # the node's directory table, no RPC per lookup
            assert index.lookup(ids).tolist() == store.lookup(ids).tolist() == [True] * 5 + [False] * 3
            assert index.lookup_prefix(ids) == store.lookup_prefix(ids) == 5
            assert index.lookup_prefix(ids[5:]) == 0 and index.lookup(ids[:0]).shape == (0,)
        finally:
            index.close()
        index.close()  # idempotent
        with pytest.raises(ValueError, match="closed"):
            index.lookup(ids)
    finally:
        store.close()


def test_a_pool_block_counts_only_with_every_shard(tmp_path, plat, daemon):
    layout = StoreLayout(LAYOUT.piece_sizes, num_shards=2)
    cfg = config_for("pool", tmp_path, layout)
    store = build_store("pool", tmp_path, plat, layout=layout)
    index = create_index(config=cfg, platform=plat, layout=layout)
    try:
        ids = random_ids(3, seed=4)
        assert (dump_blocks(store, plat, ids, layout) == 0).all()  # shard 0 only
        assert index.lookup_prefix(ids) == 0 and not index.lookup(ids).any()
    finally:
        index.close()
        store.close()


def test_a_pool_that_does_not_answer_is_a_miss_logged_once(tmp_path, plat, daemon, caplog):
    cfg = config_for("pool", tmp_path, LAYOUT)
    store = build_store("pool", tmp_path, plat)
    ids = _present_first(store, plat, 2, 2, seed=5)
    store.close()
    index = create_index(config=cfg, platform=plat, layout=LAYOUT)
    try:
        assert index.lookup_prefix(ids) == 2
        daemon.kill()
        index.client.table.close()  # a dead daemon's table is no answer: ask it over RPC
        index.client.table = None
        with caplog.at_level(logging.WARNING, logger="kvfabric.store"):
            assert [index.lookup_prefix(ids) for _ in range(3)] == [0, 0, 0]
        assert len([r for r in caplog.records if "did not answer" in r.getMessage()]) == 1
    finally:
        index.close()


@pytest.mark.parametrize(
    "spec,extra,why",
    [
        ("cache", {}, "memory of one process"),
        ("cache|pool", {"pool.embedded_dram": 1 << 20}, "embeds a pool in each process"),
        ("pool", {}, "embeds a pool in each process"),
    ],
)
def test_stores_of_one_process_have_no_index(spec, extra, why, plat):
    cfg = {"store": spec, **extra}
    assert why in (unshared_reason(spec, cfg) or "")
    threads = threading.active_count()
    with pytest.raises(UnsharedStore, match=why):
        create_index(config=cfg, platform=plat, layout=LAYOUT)
    assert threading.active_count() == threads and plat.buffers() == []


def test_shared_specs_have_no_reason(tmp_path):
    assert unshared_reason("cache|posix", {"posix.dirs": str(tmp_path)}) is None
    assert unshared_reason("cache|pool", {"pool.socket": str(tmp_path / "p.sock")}) is None
    assert unshared_reason("cache|pool", {"pool": {"tcp": "10.0.0.2:7000"}}) is None  # nested form
    with pytest.raises(ValueError, match="unknown config key"):
        create_index(config={"store": "posix", "posix.dirz": "x"}, layout=LAYOUT)
