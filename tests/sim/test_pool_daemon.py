"""The pool daemon as a subprocess with several client processes: correctness under
concurrency, and the fault cases (dead writers, a killed daemon, clean shutdown)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
from kvf_testing import segments
from pool_testing import Daemon, content

from kvfabric.errors import ServiceUnavailable
from kvfabric.pool import connect
from kvfabric.pool.status import Status

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def daemon(tmp_path, isolated_shm):
    d = Daemon(tmp_path).start()
    yield d
    assert d.stop() == 0
    assert segments(isolated_shm) == [] and not os.path.exists(d.socket)  # SIGTERM cleaned up


def _size(key: str) -> int:
    return 1 + int.from_bytes(key.encode(), "little") % 150_000


def _worker(socket: str, env: dict, wid: int, rounds: int, out) -> None:
    try:
        _work(socket, env, wid, rounds, out)
    except BaseException as e:
        out.put({"error": repr(e)})
        raise


def _work(socket: str, env: dict, wid: int, rounds: int, out) -> None:
    os.environ.update(env)
    c = connect(socket, timeout=10)
    rng = np.random.default_rng(wid)
    stats = {"put": 0, "get": 0, "bad": 0, "removed": 0, "shared": None}
    stats["shared"] = int(c.put("shared", content(f"shared-{wid}", 10_000)))
    for _i in range(rounds):
        key = f"k{int(rng.integers(0, 60))}"
        op = rng.random()
        if op < 0.5:
            # every writer stores the same bytes for a key (its size is part of the key's content)
            c.put(key, content(key, _size(key)))
            stats["put"] += 1
        elif op < 0.9:
            got = c.batch_get([key])[0]
            if got is not None:
                stats["get"] += 1
                stats["bad"] += got != content(key, _size(key))
        else:
            stats["removed"] += c.remove(key)
    out.put(stats)
    c.close()


def test_four_clients_concurrently(daemon):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    env = {k: v for k, v in os.environ.items() if k.startswith("KVFABRIC_")}
    procs = [ctx.Process(target=_worker, args=(daemon.socket, env, w, 60, out)) for w in range(4)]
    for p in procs:
        p.start()
    results = [out.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(30)
    assert not [r["error"] for r in results if "error" in r]
    assert sum(r["bad"] for r in results) == 0
    assert sum(r["get"] for r in results) > 0 and sum(r["put"] for r in results) > 0
    # duplicate puts of one key from several clients left exactly one object
    assert sorted(r["shared"] for r in results) == [Status.OK, Status.EXISTS, Status.EXISTS, Status.EXISTS]
    c = connect(daemon.socket)
    assert c.get("shared") in {content(f"shared-{w}", 10_000) for w in range(4)}
    keys = c.info()
    assert keys["objects"] >= 1
    c.close()


def _alloc_and_die(socket: str, env: dict) -> None:
    os.environ.update(env)
    c = connect(socket)
    st, _ = c.batch_alloc(["orphan"], [4 * MiB])
    assert st[0] == Status.OK
    os._exit(0)  # no commit, no cleanup


def test_dead_writer_space_is_reclaimed(tmp_path, isolated_shm):
    d = Daemon(tmp_path, extra={"write_lease_s": 1.0}).start()
    try:
        c = connect(d.socket)
        used0 = c.info()["capacity"][0]["used"]
        env = {k: v for k, v in os.environ.items() if k.startswith("KVFABRIC_")}
        p = mp.get_context("spawn").Process(target=_alloc_and_die, args=(d.socket, env))
        p.start()
        p.join(60)
        assert c.info()["capacity"][0]["used"] >= used0 + 4 * MiB
        deadline = time.monotonic() + 10
        while c.info()["capacity"][0]["used"] != used0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.info()["capacity"][0]["used"] == used0
        assert not c.exists("orphan")
        c.close()
    finally:
        d.stop()


def test_killed_daemon_then_restart_rebuilds_the_directory(tmp_path, isolated_shm):
    d = Daemon(tmp_path).start()
    c = connect(d.socket, window_bytes=2 * MiB)  # a rank with its own (small) window
    keys = [f"obj{i}" for i in range(40)]
    st = c.batch_put(keys, [content(k, 100 * KiB) for k in keys])
    assert (st == Status.OK).all()
    ranks = {c.addr.decode(int(c.table.lookup(k.encode()).gva))[1] for k in keys}
    assert ranks == {0, c.rank}  # objects in the daemon's window and in the client's
    # a second client keeps putting batches while the daemon is killed under it
    writer = connect(d.socket)
    outcome: dict = {}

    def keep_putting() -> None:
        i = 0
        try:
            while True:
                writer.batch_put([f"busy{i % 4}-{j}" for j in range(32)], [b"y" * 20_000] * 32)
                i += 1
        except ServiceUnavailable as e:
            outcome["error"], outcome["at"] = e, time.monotonic()

    t = threading.Thread(target=keep_putting)
    t.start()
    time.sleep(0.3)
    killed_at = time.monotonic()
    d.kill()  # SIGKILL mid-batch: no cleanup at all
    t.join(10)
    assert not t.is_alive() and "error" in outcome  # the writer got ServiceUnavailable...
    assert outcome["at"] - killed_at < 1.5  # ...within about a second, no hang
    writer.close()
    t0 = time.monotonic()
    with pytest.raises(ServiceUnavailable):
        c.batch_put([f"late{i}" for i in range(8)], [b"x" * 1000] * 8)
    assert time.monotonic() - t0 < 3.0
    d2 = Daemon(tmp_path).start()  # same name and socket
    try:
        c.refresh()  # the client sees the new epoch and re-registers its window's objects
        for k in keys:
            assert c.get(k) == content(k, 100 * KiB)
        assert c.put("after", b"restart") is Status.OK and c.get("after") == b"restart"
        c.close()
    finally:
        assert d2.stop() == 0
    assert segments(isolated_shm) == []


def test_http_endpoint_and_status_cli(daemon):
    c = connect(daemon.socket)
    c.batch_put(["p/a", "p/b", "q/c"], [b"1", b"2", b"3"])
    port = daemon.ready["http_port"]
    base = f"http://127.0.0.1:{port}"
    health = json.load(urllib.request.urlopen(f"{base}/health"))
    assert health["ready"] and health["objects"] == 3 and health["ranks"] == [0]
    metrics = urllib.request.urlopen(f"{base}/metrics").read().decode()
    assert 'kvfabric_pool_requests_total{op="alloc"}' in metrics and "kvfabric_pool_objects 3.0" in metrics
    cap = json.load(urllib.request.urlopen(f"{base}/capacity"))
    assert cap[0]["capacity"] == 64 * MiB
    keys = json.load(urllib.request.urlopen(f"{base}/keys?prefix=p/&limit=1"))
    assert keys == {"keys": ["p/a"], "total": 2, "next": 1}
    out = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "pool", "status", "--socket", daemon.socket, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout)["objects"] == 3
    c.close()


def test_second_daemon_on_the_same_socket_is_refused(daemon, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "pool", "serve", "--socket", daemon.socket, "--dram", "1MiB"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "already serves" in out.stderr


def test_status_without_a_daemon(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "pool", "status", "--socket", str(tmp_path / "none.sock")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and "not reachable" in out.stderr


def test_the_pools_remote_bounds_reach_every_client(tmp_path, isolated_shm):
    """``remote_read_timeout_s`` / ``remote_suspect_s`` of the pool config are what each
    client's fabric (its remote transport) runs with."""
    d = Daemon(tmp_path, extra={"remote_read_timeout_s": 0.25, "remote_suspect_s": 2}).start()
    try:
        with connect(d.socket, name="t") as c:
            cfg = c.session.fabric.config
            assert (cfg.remote_read_timeout, cfg.remote_suspect_time) == (0.25, 2.0)
    finally:
        assert d.stop() == 0
