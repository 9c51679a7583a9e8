"""The pool's client API on an embedded pool (service and client in this process)."""

from __future__ import annotations

import numpy as np
import pytest
from pool_testing import content

from kvfabric.errors import KeyNotFound, LeaseExpired, OutOfSpace
from kvfabric.pool.client import dataplane, reads
from kvfabric.pool.config import PoolConfig
from kvfabric.pool.keys import KeyBatch
from kvfabric.pool.service.node import EmbeddedPool
from kvfabric.pool.status import Status

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def pool():
    p = EmbeddedPool(PoolConfig(dram=16 * MiB, max_objects=2048, read_lease_s=0.3, pretouch=False))
    yield p
    p.close()


@pytest.fixture
def client(pool):
    c = pool.client()
    yield c
    c.close()


def host(client, nbytes: int, fill: int | None = None) -> np.ndarray:
    arr = np.zeros(nbytes, np.uint8) if fill is None else np.full(nbytes, fill, np.uint8)
    client.platform.wrap(arr)
    return arr


def test_bytes_api(client):
    assert client.put("a", b"hello") is Status.OK
    assert client.put("a", b"other") is Status.EXISTS
    assert client.get("a") == b"hello" and client.exists("a") and not client.exists("b")
    with pytest.raises(KeyNotFound):
        client.get("b")
    st = client.batch_put(["x", "y", "a"], [b"1", b"22", b"333"])
    assert st.tolist() == [Status.OK, Status.OK, Status.EXISTS]
    assert client.batch_get(["x", "nope", "y"]) == [b"1", None, b"22"]
    assert client.batch_exists(["x", "nope"]).tolist() == [True, False]
    assert client.batch_remove(["x", "nope"]).tolist() == [Status.OK, Status.NOT_FOUND]
    assert client.remove("y") and not client.remove("y")
    with pytest.raises(ValueError, match="empty"):
        client.put("e", b"")
    with pytest.raises(ValueError, match="longer than 256"):
        client.put("k" * 300, b"x")


def test_zero_copy_and_layers(client):
    data = np.frombuffer(content("obj", 300 * KiB), np.uint8).copy()
    client.platform.wrap(data)
    out = host(client, 300 * KiB)
    assert client.put_from("obj", data.ctypes.data, data.nbytes) is Status.OK
    assert client.get_into("obj", out.ctypes.data, out.nbytes) == data.nbytes
    assert np.array_equal(out, data)
    with pytest.raises(ValueError, match="holds 307200 B"):
        client.get_into("obj", out.ctypes.data, 1000)
    # one object gathered from 2 x 4 layer pieces, scattered back elsewhere
    layers = [host(client, 16 * KiB, fill=i) for i in range(8)]
    ptrs = [a.ctypes.data for a in layers]
    assert client.put_from_layers("blk", ptrs, [16 * KiB] * 8) is Status.OK
    back = [host(client, 16 * KiB) for _ in range(8)]
    assert client.get_into_layers("blk", [a.ctypes.data for a in back], [16 * KiB] * 8) == 128 * KiB
    assert all((b == i).all() for i, b in enumerate(back))
    whole = host(client, 128 * KiB)
    client.get_into("blk", whole.ctypes.data, whole.nbytes)
    assert np.array_equal(whole.reshape(8, -1)[:, 0], np.arange(8))


def test_batched_zero_copy(client):
    n, size = 32, 64 * KiB
    src = host(client, n * size)
    for i in range(n):
        src[i * size : (i + 1) * size] = np.frombuffer(content(f"b{i}", size), np.uint8)
    keys = [f"b{i}" for i in range(n)]
    ptrs = src.ctypes.data + np.arange(n) * size
    assert (client.batch_put_from(keys, ptrs, [size] * n) == Status.OK).all()
    dst = host(client, n * size)
    dst_ptrs = [*(dst.ctypes.data + np.arange(n) * size).tolist(), dst.ctypes.data]
    st = client.batch_get_into([*keys, "missing"], dst_ptrs, [size] * (n + 1))
    assert st.tolist() == [Status.OK] * n + [Status.NOT_FOUND]
    assert np.array_equal(src, dst)
    # layer-wise batches: (k, m) pointers
    P = (dst.ctypes.data + np.arange(n) * size)[:4, None] + np.array([0, size // 2])
    st = client.batch_put_from_layers([f"L{i}" for i in range(4)], P, [size // 2, size // 2])
    assert (st == Status.OK).all()
    got = host(client, 4 * size)
    P2 = (got.ctypes.data + np.arange(4) * size)[:, None] + np.array([0, size // 2])
    assert (client.batch_get_into_layers([f"L{i}" for i in range(4)], P2, [size // 2] * 2) == 0).all()
    assert np.array_equal(got, dst[: 4 * size])


def test_binary_key_batches(client):
    """Fixed-width binary keys (a ``KeyBatch`` built from an id array) through every batch
    call, and single calls with the same keys as bytes."""
    n, size = 8, 4 * KiB
    ids = np.random.default_rng(5).integers(0, 256, (n, 16), dtype=np.uint8)
    ids[0] = 0  # a key ending in zero bytes is a key like any other
    keys = KeyBatch.of_ids(b"bin/", ids, b"\x00")
    src = host(client, n * size)
    src[:] = np.frombuffer(content("binary", n * size), np.uint8)
    ptrs = src.ctypes.data + np.arange(n) * size
    assert (client.batch_put_from(keys, ptrs, [size] * n) == Status.OK).all()
    assert client.batch_exists(keys).all() and client.exists(keys[3])
    assert not client.exists(keys[3][:-1] + b"\x01")
    dst = host(client, n * size)
    st = client.batch_get_into(keys, dst.ctypes.data + np.arange(n) * size, [size] * n)
    assert (st == Status.OK).all() and np.array_equal(src, dst)
    assert client.get(keys[0]) == src[:size].tobytes()
    assert (client.batch_remove(keys) == Status.OK).all() and not client.batch_exists(keys).any()


def test_layerwise_alloc_write_commit(client):
    st, gvas = client.batch_alloc(["lw1", "lw2"], [8 * KiB, 8 * KiB])
    assert (st == Status.OK).all()
    assert not client.exists("lw1")  # not visible before commit
    for layer in range(4):  # pieces arrive layer by layer
        piece = host(client, 2 * KiB, fill=layer + 1)
        client.write([int(g) + layer * 2 * KiB for g in gvas], [piece.ctypes.data] * 2, [2 * KiB] * 2)
    assert client.batch_commit(["lw1", "lw2"], [True, False]).tolist() == [Status.OK, Status.OK]
    assert client.exists("lw1") and not client.exists("lw2")
    assert client.get("lw1") == b"".join(bytes([i + 1]) * 2 * KiB for i in range(4))


def test_buffers_must_be_known_to_the_platform(client):
    stray = np.zeros(4096, np.uint8)  # never registered nor wrapped
    with pytest.raises(ValueError, match="not inside any live buffer"):
        client.put_from("s", stray.ctypes.data, 4096)
    reg = client.register_buffer(stray.ctypes.data, stray.nbytes)
    assert client.put_from("s", stray.ctypes.data, 4096) is Status.OK
    client.unregister_buffer(reg)


def test_out_of_space(client):
    big = host(client, 20 * MiB)
    with pytest.raises(OutOfSpace):
        client.put_from("huge", big.ctypes.data, big.nbytes)


def test_metadata_only_client(pool, client):
    client.put("m", b"v")
    meta = pool.client(metadata_only=True)
    assert meta.exists("m") and meta.batch_exists(["m", "n"]).tolist() == [True, False]
    with pytest.raises(ValueError, match="metadata-only"):
        meta.get("m")
    meta.close()


def test_fast_path_reader_never_returns_bytes_of_a_reused_extent(pool, client, monkeypatch):
    """The object is removed and its space rewritten while a reader copies: the reader's
    after-copy check discards the copy; it returns a miss or the new whole object."""
    client.put("race", content("race", 64 * KiB))
    other = pool.client()
    real = dataplane.ctypes.memmove
    fired = []

    def racing_memmove(dst, src, n):
        if not fired:
            fired.append(1)
            other.remove("race")
            other.put("race", content("race2", 64 * KiB))  # reuses the freed extent
            other.put("x", b"y" * 64 * KiB)
        return real(dst, src, n)

    monkeypatch.setattr(dataplane.ctypes, "memmove", racing_memmove)  # the fast-path copy
    out = host(client, 64 * KiB)
    client.get_into("race", out.ctypes.data, out.nbytes)
    assert fired and out.tobytes() == content("race2", 64 * KiB)
    other.close()


def test_slow_remote_reader_gets_lease_expired_not_wrong_bytes(pool, client, monkeypatch):
    remote = pool.client(local_reads=False)  # reads through RPC read leases
    client.put("slow", content("slow", 64 * KiB))
    real = reads.Reader._copy_out

    def slow_copy(self, *args):
        import time

        time.sleep(0.5)  # longer than read_lease_s = 0.3
        return real(self, *args)

    monkeypatch.setattr(reads.Reader, "_copy_out", slow_copy)
    out = host(remote, 64 * KiB)
    with pytest.raises(LeaseExpired):
        remote.get_into("slow", out.ctypes.data, out.nbytes)
    monkeypatch.setattr(reads.Reader, "_copy_out", real)
    assert remote.get_into("slow", out.ctypes.data, out.nbytes) == 64 * KiB
    assert out.tobytes() == content("slow", 64 * KiB)
    remote.close()


def test_eviction_spares_leased_objects(pool, client):
    remote = pool.client(local_reads=False)
    for i in range(14):
        client.put(f"e{i}", content(f"e{i}", MiB))
    r = remote.transport.call(__import__("kvfabric.pool.protocol", fromlist=["Lookup"]).Lookup([b"e0"]))
    assert r.status == [Status.OK]  # e0 is under a read lease now
    for i in range(14, 30):
        client.put(f"e{i}", content(f"e{i}", MiB))
    assert client.exists("e0")  # oldest, but leased: kept
    assert not client.exists("e1")  # oldest unleased: evicted
    assert client.get("e29") == content("e29", MiB)
    cap = client.info()["capacity"][0]
    assert cap["evictions"] > 0 and cap["used"] <= 16 * MiB
    remote.close()


def test_listing_keys_pages_them_without_holding_the_service_lock(pool, client, monkeypatch):
    """``ListKeys`` copies the readable keys under the lock and decodes, sorts and pages them
    after letting go: a metadata RPC is never held up by the listing of a large pool."""
    from kvfabric.pool import protocol as p
    from kvfabric.pool.service import dispatch

    keys = [f"kv/{i:04d}" for i in range(300)] + ["other/x", b"kv/\x8a\x00"]
    assert (client.batch_put(keys, [b"v"] * len(keys)) == Status.OK).all()
    d = pool.dispatcher
    held = []
    real = dispatch.key_text
    monkeypatch.setattr(dispatch, "key_text", lambda k: held.append(d.lock.locked()) or real(k))
    reply = d.handle(p.ListKeys(b"kv/", 10, 5))
    assert not reply.error and held and not any(held)
    assert reply.data == {"keys": [f"kv/{i:04d}" for i in range(10, 15)], "total": 301, "next": 15}
    last = d.handle(p.ListKeys(b"kv/", 300, 10)).data
    assert last == {"keys": ["kv/\\x8a\\x00"], "total": 301, "next": None}
    assert "list_keys" in d.handle(p.ListKeys("kv/", 0, 1)).error  # a str prefix: refused, named


def test_on_node_reads_are_counted_in_the_table_and_exported(pool, client):
    """Reads served from the node's memory never reach the service; the clients count them
    in the table header and /metrics exports them. A planted flipped byte counts as corrupt."""
    import ctypes

    assert client.table is not None  # on the pool's node: reads go through the table
    assert client.put("a", b"x" * 100) is Status.OK and client.put("b", b"y" * 4096) is Status.OK
    assert client.get("a") == b"x" * 100
    assert client.batch_get(["zz"]) == [None]  # a miss
    bufs = [np.zeros(n, np.uint8) for n in (100, 4096, 8)]
    regs = [client.register_buffer(b.ctypes.data, b.nbytes) for b in bufs]
    st = client.batch_get_into(["a", "b", "nope"], [b.ctypes.data for b in bufs], [b.nbytes for b in bufs])
    for r in regs:
        client.unregister_buffer(r)
    assert st.tolist() == [Status.OK, Status.OK, Status.NOT_FOUND]
    hit = client.table.lookup(b"b")
    ptr, _ = client.dp.local(int(hit.gva) + 7, 1)
    ctypes.c_uint8.from_address(ptr).value ^= 0x5A  # the planted fault
    assert client.batch_get(["b"]) == [None]
    counts = pool.table.local_reads()
    assert counts == {"local_keys": 6, "local_hits": 3, "local_hit_bytes": 4296, "local_corrupt": 1}, counts
    d = pool.dispatcher
    d.metrics.update_state(d.service)
    text = d.metrics.render().decode()
    assert "kvfabric_pool_local_hits_total 3.0" in text and "kvfabric_pool_local_corrupt_total 1.0" in text
