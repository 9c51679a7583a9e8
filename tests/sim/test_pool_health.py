"""``/health``: 200 while a pool node is fit for traffic, 503 naming what is not."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from kvfabric.pool.config import PoolConfig
from kvfabric.pool.service.health import RENDEZVOUS_TIMEOUT_S, Check, check_health
from kvfabric.pool.service.http import HttpEndpoint
from kvfabric.pool.service.node import EmbeddedPool
from kvfabric.pool.status import Status

MiB = 1 << 20


@pytest.fixture
def pool():
    p = EmbeddedPool(PoolConfig(dram=4 * MiB, max_objects=256, pretouch=False))
    yield p
    p.close()


def _get(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_ready_then_503_while_no_space_then_ready_again(pool):
    http = HttpEndpoint(pool.dispatcher, "127.0.0.1", 0, lambda: check_health(pool))
    http.start()
    c = pool.client()
    try:
        code, body = _get(http.port)
        assert code == 200 and body["ready"] and body["ranks"] == [0] and "failing" not in body
        st, _ = c.batch_alloc(["held"], [4 * MiB - 4096])  # a write lease holds the window
        assert st.tolist() == [Status.OK]
        st, _ = c.batch_alloc(["more"], [64 * 1024])  # fits the window; nothing evictable
        assert st.tolist() == [Status.NO_SPACE]
        code, body = _get(http.port)
        assert code == 503 and not body["ready"] and list(body["failing"]) == ["space"]
        assert "refused for space" in body["failing"]["space"]
        st, _ = c.batch_alloc(["huge"], [64 * MiB])  # larger than any window: not the pool's state
        assert st.tolist() == [Status.NO_SPACE] and list(_get(http.port)[1]["failing"]) == ["space"]
        c.batch_commit(["held"], [False])  # the writer gives the space back
        st, _ = c.batch_alloc(["more"], [64 * 1024])
        assert st.tolist() == [Status.OK]
        assert _get(http.port)[0] == 200
    finally:
        c.close()
        http.stop()


def test_an_unreachable_rendezvous_and_a_left_fabric_are_named(pool):
    assert check_health(pool).ready
    pool.rdv.close()  # the node's own rendezvous server stops answering
    t0 = time.monotonic()
    h = check_health(pool)
    assert not h.ready and Check.RENDEZVOUS in h.failing, h.failing
    assert time.monotonic() - t0 < RENDEZVOUS_TIMEOUT_S + 5  # a probe never hangs on the store
    pool.fabric.leave()
    h = check_health(pool)
    assert Check.FABRIC in h.failing and "not joined" in h.failing[Check.FABRIC]
    assert h.as_json()["failing"]["fabric"] == h.failing[Check.FABRIC]


def test_a_gone_table_is_503(pool):
    http = HttpEndpoint(pool.dispatcher, "127.0.0.1", 0, lambda: check_health(pool))
    http.start()
    try:
        assert _get(http.port)[0] == 200
        pool.table.retire()  # what a restarted service does to the table it replaces
        code, body = _get(http.port)
        assert code == 503 and "retired" in body["failing"]["table"]
    finally:
        http.stop()
