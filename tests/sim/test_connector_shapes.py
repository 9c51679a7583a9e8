"""The connector's stores in the shapes vLLM runs them, without vLLM: a worker in another
process than the scheduler (the CPU build's default, every TP rank) meets it in the
node's auto-started pool daemon; the scheduler's lookups go through an index (no store of
its own); everything in one process shares the worker's store; the daemon goes with its
last client."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest
from daemon_exit import gone, wait_gone
from kvf_testing import segments
from stores import LAYOUT, dump_blocks, random_ids

from kvfabric.platform.sim import SimPlatform
from kvfabric.pool.autostart import daemon_pid, probe
from kvfabric.status import ItemStatus
from kvfabric.ucm_layer.connector import stores
from kvfabric.ucm_layer.connector.config import load_config
from kvfabric.ucm_layer.store.index import PoolIndex

EXTRA = {"store": "cache|pool", "cache_bytes": "1MiB", "pool_bytes": "16MiB", "pool_idle_exit_s": 1.0}


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("KVFABRIC_PLATFORM", "sim")
    return tmp_path


@pytest.fixture
def plat():
    p = SimPlatform()
    yield p
    p.close()


def _worker(env: dict, ids: np.ndarray, out) -> None:
    """A worker process: its store (the movers) for the same configuration, one dump."""
    os.environ.update(env)
    plat = SimPlatform()
    store = stores.acquire(load_config(EXTRA).placed(one_process=False), plat, LAYOUT)
    try:
        out.put(dump_blocks(store, plat, ids).tolist())
    finally:
        stores.release(store)
        plat.close()


def test_a_worker_process_and_the_scheduler_meet_in_the_auto_started_daemon(runtime, plat, isolated_shm):
    cfg = load_config(EXTRA).placed(one_process=False)
    assert cfg.pool_address == "auto"
    ids = random_ids(6, seed=9)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    env = {k: os.environ[k] for k in ("XDG_RUNTIME_DIR", "KVFABRIC_SHM_DIR", "KVFABRIC_PLATFORM")}
    # the scheduler's index comes first: it holds the daemon open, which would otherwise
    # leave pool_idle_exit_s after the worker's store, before a slow machine gets here
    index = stores.SchedulerIndex(cfg, plat, LAYOUT)
    try:
        p = ctx.Process(target=_worker, args=(env, ids[:4], out))
        p.start()
        assert out.get(timeout=120) == [0] * 4
        p.join(30)
        assert index.lookup_prefix(ids) == 4  # what the other process stored
        assert isinstance(index.index, PoolIndex)  # an index, not a store: no cache, no threads
        assert index.index.client.metadata_only and index.index.client.fabric is None
        assert plat.buffers() == []
        sock = stores.store_config(cfg)["pool.socket"]
        pid = daemon_pid(sock)
        assert probe(sock) is not None and not gone(pid)
    finally:
        index.close()
    wait_gone(pid, sock)  # its last client left
    assert segments(isolated_shm) == []


def test_in_one_process_the_scheduler_answers_from_the_workers_store(runtime, plat):
    cfg = load_config(EXTRA).placed(one_process=True)
    assert cfg.pool_address == "embedded"
    ids = random_ids(5, seed=10)
    index = stores.SchedulerIndex(cfg, plat, LAYOUT)
    assert index.lookup_prefix(ids) == 0 and index.index is None  # no worker store yet: nothing stored
    store = stores.acquire(cfg, plat, LAYOUT)
    try:
        assert (dump_blocks(store, plat, ids[:3]) == ItemStatus.OK).all()
        assert index.lookup_prefix(ids) == 3 and index.index is store
        index.close()
        assert not store._closed  # the worker's store is the worker's to close
    finally:
        stores.release(store)
    assert not any(n.endswith(".sock") for n in os.listdir(runtime))  # no daemon for one process
