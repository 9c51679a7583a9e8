"""Requests with bad fields sent straight to a real daemon's socket, skipping every client
check: each gets a clear error reply, the directory and the capacity are unchanged
afterwards, and the daemon keeps serving (the same connection and new ones)."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import socket
import struct
import subprocess
import sys
import urllib.error
import urllib.request
from multiprocessing.connection import Client, Connection

import msgspec
import numpy as np
import pytest
from kvf_testing import segments
from pool_testing import Daemon, content

from kvfabric.platform.types import Medium
from kvfabric.pool import EmbeddedPool, connect
from kvfabric.pool import protocol as p
from kvfabric.pool.client.rpc import SocketTransport
from kvfabric.pool.config import PoolConfig
from kvfabric.pool.gva.address import base as region_base
from kvfabric.pool.keys import MAX_BATCH
from kvfabric.pool.service.local import LocalTransport
from kvfabric.pool.windows import FixedStride

KiB = 1 << 10


@pytest.fixture
def daemon(tmp_path, isolated_shm):
    d = Daemon(tmp_path, name="bad").start()
    yield d
    assert d.stop() == 0
    assert segments(isolated_shm) == [] and not os.path.exists(d.socket)


def _call(conn: Connection, msg: object) -> p.Reply:
    """One raw request: a dict (any fields, any types) or already encoded bytes."""
    conn.send_bytes(msg if isinstance(msg, bytes) else msgspec.msgpack.encode(msg))
    return p.decode_reply(conn.recv_bytes())


def _state(conn: Connection) -> tuple:
    """What a bad request must not change: objects, keys, every window's use."""
    info = _call(conn, {"type": "info"}).data
    keys = _call(conn, {"type": "list_keys", "limit": 10_000}).data["keys"]
    return info["objects"], sorted(keys), [(w["rank"], w["used"], w["free"]) for w in info["capacity"]]


def _alloc(keys: list, sizes: list, **extra: object) -> dict:
    return {"type": "alloc", "client": "raw", "keys": keys, "sizes": sizes, **extra}


def _bad_requests(stride: int, window: int) -> list[tuple[str, object, str]]:
    """``(what, request, a word the error must contain)``."""
    addr = FixedStride(stride)
    gva0 = addr.encode(Medium.DRAM, 0, 0)  # rank 0's DRAM window (the daemon's own)
    rereg = {"type": "reregister", "keys": [b"r"], "gvas": [gva0], "sizes": [KiB], "gens": [1]}
    return [
        ("empty key", _alloc([b""], [KiB]), "keys[0]"),
        ("10 KB key", _alloc([b"k" * 10_000], [KiB]), "keys[0]"),
        ("reserved key", _alloc([b"ok", b"\xff\xfe"], [KiB, KiB]), "reserved"),
        ("key of the wrong type", _alloc(["text"], [KiB]), "keys[0]"),
        ("keys not a list", _alloc(b"abc", [KiB]), "keys"),
        ("negative size", _alloc([b"a", b"b"], [KiB, -1]), "sizes[1]"),
        ("zero size", _alloc([b"a"], [0]), "sizes[0]"),
        ("size past a window's address range", _alloc([b"a"], [1 << 63]), "sizes[0]"),
        ("largest uint64 size", _alloc([b"a"], [(1 << 64) - 1]), "sizes[0]"),
        ("most negative size", _alloc([b"a"], [-(1 << 63)]), "sizes[0]"),
        ("size of the wrong type", _alloc([b"a"], ["1KiB"]), "sizes[0]"),
        ("fewer sizes than keys", _alloc([b"a", b"b"], [KiB]), "sizes"),
        ("absurd count", _alloc([b"k"] * (MAX_BATCH + 1), [1] * (MAX_BATCH + 1)), "keys"),
        ("unknown medium", _alloc([b"a"], [KiB], medium="tape"), "medium"),
        ("unknown preferred rank", _alloc([b"a"], [KiB], preferred_rank=99), "preferred_rank"),
        ("negative home rank", _alloc([b"a"], [KiB], home_rank=-1), "home_rank"),
        ("home rank past the address space", _alloc([b"a"], [KiB], home_rank=1 << 59), "home_rank"),
        ("client id of 10 KB", {**_alloc([b"a"], [KiB]), "client": "c" * 10_000}, "client"),
        (
            "commit: fewer flags than keys",
            {"type": "commit", "client": "raw", "keys": [b"a"], "ok": []},
            "ok",
        ),
        ("commit: flags not booleans", {"type": "commit", "client": "raw", "keys": [b"a"], "ok": [1]}, "ok"),
        (
            "commit: negative ttl",
            {"type": "commit", "client": "raw", "keys": [b"a"], "ok": [True], "ttl_s": -1},
            "ttl_s",
        ),
        (
            "commit: ttl past the clock",
            {"type": "commit", "client": "raw", "keys": [b"a"], "ok": [True], "ttl_s": 1e12},
            "ttl_s",
        ),
        (
            "commit: NaN ttl",
            {"type": "commit", "client": "raw", "keys": [b"a"], "ok": [True], "ttl_s": float("nan")},
            "ttl_s",
        ),
        ("lookup: empty key", {"type": "lookup", "keys": [b"x", b""]}, "keys[1]"),
        ("lookup: lease not a boolean", {"type": "lookup", "keys": [b"x"], "lease": "yes"}, "lease"),
        ("exists: a fence's key", {"type": "exists", "keys": [b"\xff\xfefence:1"]}, "reserved"),
        (
            "remove: reserved key among good ones",
            {"type": "remove", "keys": [b"keep-0", b"\xff\xfe\x80"]},
            "keys[1]",
        ),
        ("release: negative lease id", {"type": "release", "lease_ids": [-1]}, "lease_ids[0]"),
        ("reregister: not a GVA", {**rereg, "gvas": [12345]}, "gvas[0]"),
        ("reregister: rank without a window", {**rereg, "gvas": [addr.encode(Medium.DRAM, 7, 0)]}, "gvas[0]"),
        ("reregister: past the window's end", {**rereg, "gvas": [gva0 + window - 256]}, "gvas[0]"),
        ("reregister: lists of different lengths", {**rereg, "gens": [1, 2]}, "gens"),
        ("reregister: zero size", {**rereg, "sizes": [0]}, "sizes[0]"),
        ("list_keys: negative start", {"type": "list_keys", "start": -1}, "start"),
        ("list_keys: negative limit", {"type": "list_keys", "limit": -5}, "limit"),
        ("list_keys: 10 KB prefix", {"type": "list_keys", "prefix": b"p" * 10_000}, "prefix"),
        ("unknown request type", {"type": "format_disk"}, "format_disk"),
        ("not a mapping", msgspec.msgpack.encode([1, 2, 3]), "array"),
        ("garbage bytes", b"\xc1\xff\x00garbage", "malformed"),
        ("empty frame", b"", "malformed"),
        ("truncated msgpack", msgspec.msgpack.encode(_alloc([b"a"], [KiB]))[:-3], "malformed"),
    ]


def test_bad_requests_on_the_socket_are_refused_and_change_nothing(daemon):
    c = connect(daemon.socket, timeout=10)
    try:
        values = {f"keep-{i}": content(f"keep-{i}", 3000 + i) for i in range(5)}
        for k, v in values.items():
            c.put(k, v)
        conn = Client(daemon.socket, family="AF_UNIX")
        info = _call(conn, {"type": "info"}).data
        window = next(w["capacity"] for w in info["capacity"] if w["rank"] == 0)
        before = _state(conn)
        problems = []
        for what, req, word in _bad_requests(info["stride"], window):
            reply = _call(conn, req)
            if not reply.error:
                problems.append(f"{what}: accepted ({reply})")
            elif word.lower() not in reply.error.lower():
                problems.append(f"{what}: error {reply.error!r} does not name {word!r}")
            if reply.epoch != info["epoch"]:
                problems.append(f"{what}: reply without the service epoch")
            if _state(conn) != before:
                problems.append(f"{what}: changed the pool: {before} -> {_state(conn)}")
        assert not problems, "\n".join(problems)
        # the daemon keeps serving, on this connection and through a client
        assert _call(conn, {"type": "exists", "keys": [b"keep-0", b"nope"]}).flags == [True, False]
        conn.close()
        assert all(c.get(k) == v for k, v in values.items())
        c.put("after", b"still serving")
        assert c.get("after") == b"still serving"
    finally:
        c.close()


def _raw_unix(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return s


def test_broken_frames_close_only_their_connection(daemon):
    c = connect(daemon.socket, timeout=10)
    try:
        c.put("k", b"v" * 100)
        # a header claiming far more than MAX_FRAME: refused without buffering it
        with _raw_unix(daemon.socket) as s:
            s.sendall(struct.pack("!i", -1) + struct.pack("!Q", 1 << 40))
            s.settimeout(10)
            assert s.recv(16) == b""  # the daemon closed this connection
        # a frame cut short by its sender
        with _raw_unix(daemon.socket) as s:
            s.sendall(struct.pack("!i", 100) + b"\x82" * 10)
        # a header only, then silence: other connections are served meanwhile
        with _raw_unix(daemon.socket) as stuck:
            stuck.sendall(struct.pack("!i", 50))
            assert c.get("k") == b"v" * 100
            conn = Client(daemon.socket, family="AF_UNIX")
            assert _call(conn, {"type": "exists", "keys": [b"k"]}).flags == [True]
            conn.close()
        assert c.info()["objects"] == 1
        # the HTTP endpoint passes the service's refusal on as a 400
        base = f"http://127.0.0.1:{daemon.ready['http_port']}"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{base}/keys?start=-1")
        assert e.value.code == 400 and "start = -1" in json.load(e.value)["error"]
        assert json.load(urllib.request.urlopen(f"{base}/keys"))["keys"] == ["k"]
    finally:
        c.close()


# ---------------------------------------------------------------------------- in process
@pytest.fixture
def embedded():
    pool = EmbeddedPool(PoolConfig(name="bad-embedded", dram=4 << 20, max_objects=256, pretouch=False))
    c = pool.client()
    yield pool, c
    c.close()
    pool.close()


def _used(pool: EmbeddedPool) -> tuple:
    info = pool.dispatcher.info()
    return info["objects"], [(w["used"], w["free"]) for w in info["capacity"]]


def test_the_dispatcher_checks_in_process_requests_too(embedded):
    """The embedded transport skips the wire decoder: the dispatcher's own checks refuse
    the same requests, whole, before the service changes anything."""
    pool, _ = embedded
    before = _used(pool)
    bad = [
        (p.Alloc("x", [b"good", b"\xff\xfe-reserved"], [KiB, KiB]), "keys[1]"),
        (p.Alloc("x", [b"good", "str"], [KiB, KiB]), "keys[1]"),
        (p.Alloc("x", [b"good", b""], [KiB, KiB]), "keys[1]"),
        (p.Alloc("x", [b"a", b"b"], [KiB, -1]), "sizes[1] = -1: must be > 0"),
        (p.Alloc("x", [b"a"], [1.5]), "sizes[0] = 1.5: must be an integer"),
        (p.Alloc("x", [b"a"], [True]), "sizes[0]"),
        (p.Alloc("x", [b"a", b"b"], [KiB]), "2 keys but 1 sizes"),
        (p.Alloc("x", [b"a"], [KiB], preferred_rank=42), "preferred_rank 42"),
        (p.Commit("x", [b"a"], [True, False]), "1 keys but 2 ok"),
        (p.Commit("x", [b"a"], [True], ttl_s=-3.0), "ttl_s"),
        (p.Release([-2]), "lease_ids[0] = -2"),
        (p.Reregister([b"r"], [region_base(Medium.DRAM)], [8 << 20], [1]), "run past"),
        (p.ListKeys(b"", -1, 10), "start = -1"),
    ]
    for req, words in bad:
        reply = pool.dispatcher.handle(req)
        assert words in reply.error, (req, reply.error)
        assert _used(pool) == before, req
    with pytest.raises(ValueError, match=r"keys\[1\]"):  # through the client's transport
        LocalTransport(pool.dispatcher).call(p.Exists([b"ok", b"\xff\xfe\x28"]))


def test_client_arguments_are_value_errors_naming_them_before_any_copy(embedded):
    pool, c = embedded
    src = np.arange(4 * KiB, dtype=np.uint8)
    reg = c.platform.wrap(src)
    base = src.ctypes.data
    before = _used(pool)
    try:
        cases = [
            (
                lambda: c.batch_put_from(["a", "b", "c", "d"], [base] * 4, [KiB, KiB, KiB, -1]),
                r"sizes\[3\] = -1",
            ),
            (lambda: c.batch_put_from(["a"], [base], [1.5]), r"sizes\[0\] = 1.5: must be an integer"),
            (
                lambda: c.batch_put_from(["a"], [base], np.array([0], np.int64)),
                r"sizes\[0\] = 0: must be > 0",
            ),
            (lambda: c.batch_put_from(["a"], [-base], [KiB]), r"ptrs\[0\]"),
            (lambda: c.batch_put_from(["a", "b"], [base, 12345], [KiB, KiB]), r"ptrs\[1\] = 0x3039"),
            (lambda: c.batch_put_from_layers(["a"], [[base, base]], [KiB, 1 << 63]), "add up past"),
            (lambda: c.put_from("a", base, -5), "nbytes = -5: must be > 0"),
            (lambda: c.put_from("a", base, 2.0), "nbytes = 2.0: must be an integer"),
            (lambda: c.put_from("a", 0, KiB), "ptr = 0: must be > 0"),
            (lambda: c.batch_alloc(["a", "b"], [KiB, -1]), r"sizes\[1\] = -1"),
            (lambda: c.write([region_base(Medium.DRAM)], [base], [-1]), r"sizes\[0\] = -1"),
            (lambda: c.get_into("a", base, -1), "nbytes = -1"),
            (lambda: c.batch_get_into(["a"], [base], [-KiB]), r"sizes\[0\]"),
            (lambda: c.batch_get_into_layers(["a"], [[base]], [[0]]), r"sizes\[0\] = 0"),
        ]
        for call, match in cases:
            with pytest.raises(ValueError, match=match):
                call()
            assert _used(pool) == before, match
    finally:
        c.platform.free(reg)


def test_register_buffer_refuses_memory_this_process_has_not_mapped(embedded):
    _, c = embedded
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    addr = libc.mmap(
        None, 3 * page, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
    )
    assert addr not in (None, ctypes.c_void_p(-1).value)
    try:
        buf = c.register_buffer(addr, 3 * page)  # mapped: fine
        c.unregister_buffer(buf)
        assert libc.munmap(addr + page, page) == 0  # a hole in the middle
        with pytest.raises(ValueError, match=f"{addr + page:#x}.*not mapped readable"):
            c.register_buffer(addr, 3 * page)
        assert libc.mprotect(addr, page, 0) == 0  # mapped but not readable
        with pytest.raises(ValueError, match="not mapped readable"):
            c.register_buffer(addr, page)
        with pytest.raises(ValueError, match="nbytes = -1"):
            c.register_buffer(addr, -1)
        with pytest.raises(ValueError, match="not a possible address range"):
            c.register_buffer((1 << 64) - page, 2 * page)
    finally:
        libc.munmap(addr, page)
        libc.munmap(addr + 2 * page, page)


def test_a_request_longer_than_a_frame_is_refused_before_sending(daemon, monkeypatch):
    t = SocketTransport(daemon.socket, timeout=10)
    try:
        assert t.call(p.Exists([b"k" * 200] * 10)).flags == [False] * 10
        monkeypatch.setattr(p, "MAX_FRAME", 1000)
        with pytest.raises(ValueError, match="longer than 1000 B"):
            t.call(p.Exists([b"k" * 200] * 10))
        assert t.call(p.Exists([b"k"])).flags == [False]  # the connection is still good
    finally:
        t.close()


@pytest.mark.parametrize(
    "yaml,message",
    [
        ("pretouch: maybe\n", "pool config pretouch='maybe': expected a boolean"),
        ("prettouch: true\n", "unknown pool config key(s) ['prettouch']; known: ['align',"),
        ("max_objects: lots\n", "pool config max_objects='lots': expected an integer"),
    ],
)
def test_a_bad_config_file_stops_the_daemon_with_the_key_and_no_traceback(
    tmp_path, isolated_shm, yaml, message
):
    cfg = tmp_path / "pool.yaml"
    cfg.write_text(f"name: badcfg\nsocket: {tmp_path / 'p.sock'}\n{yaml}")
    out = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "pool", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert segments(isolated_shm) == [] and not (tmp_path / "p.sock").exists()
