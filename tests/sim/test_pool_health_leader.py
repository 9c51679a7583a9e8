"""``/health`` of meta services that campaign (``leader_election``): real etcd, two real
daemon subprocesses, each a node of its own (a shared-memory directory of its own).

The leader answers 200 ``role: leader``; the standby 503 ``role: standby``, ``ready:
false``, failing only ``leader``, naming the leader it knows (``?standby=ok``: 200, fit
to take over). The leader stops (its lease revoked): the standby leads and turns ready.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from etcd_server import etcd_binary, etcd_server
from pool_testing import Daemon, campaigning_daemons

needs_etcd = pytest.mark.skipif(etcd_binary() is None, reason="etcd not installed (etcd-server)")

TOKEN = "health-pool-token"


def _health(d: Daemon, query: str = "") -> tuple[int, dict]:
    url = f"http://127.0.0.1:{d.ready['http_port']}/health{query}"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _wait(fn, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.05)
    raise TimeoutError("condition not met")


@needs_etcd
def test_a_standby_says_it_is_not_the_leader_and_turns_ready_when_it_leads(tmp_path: Path):
    ds: list[Daemon] = []
    with etcd_server() as etcd:
        try:
            ds = campaigning_daemons(
                tmp_path, tmp_path, etcd, "hl", 2, TOKEN, leader_ttl_s=2, write_lease_s=0.5
            )

            def roles() -> dict[str, Daemon] | None:
                by = {_health(d)[1]["role"]: d for d in ds}
                return by if set(by) == {"leader", "standby"} else None

            by = _wait(roles)
            lead, standby = by["leader"], by["standby"]
            code, body = _health(lead)
            assert code == 200 and body["ready"] is True and body["role"] == "leader", body
            assert body["terms"] == 1 and "failing" not in body
            leader_rpc = body["leader"]
            assert leader_rpc.endswith(f":{lead.ready['tcp_port']}"), body

            code, body = _wait(lambda: (r := _health(standby))[1].get("leader") and r)
            assert code == 503 and body["ready"] is False and body["role"] == "standby", body
            assert list(body["failing"]) == ["leader"], body
            assert "standby" in body["failing"]["leader"] and leader_rpc in body["failing"]["leader"]
            assert body["leader"] == leader_rpc and body["terms"] == 0 and "epoch" in body
            code, body = _health(standby, "?standby=ok")
            assert code == 200 and body["ready"] is False, body  # alive, fit to take over
            assert _health(lead, "?standby=ok")[0] == 200

            assert lead.stop() == 0  # gives the key up: the standby leads at once
            code, body = _wait(lambda: (r := _health(standby))[0] == 200 and r)
            assert body["role"] == "leader" and body["ready"] is True and body["terms"] == 1, body
            assert body["leader"].endswith(f":{standby.ready['tcp_port']}"), body
        finally:
            for d in ds:
                d.stop()
