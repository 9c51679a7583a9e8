"""The platform contract suite. Tier test files import * from here and provide the
``spec`` fixture (a platform spec understood by ``platforms.build``)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import threading
from itertools import product

import numpy as np
import pytest
from platforms import build, child_write_and_digest, inject_copy_failure, pattern

from kvfabric.errors import HandleError, KVFabricError, TransferFailed
from kvfabric.platform import handles
from kvfabric.platform.types import BufferKind, CopyBatch, Medium

MEDIA = [Medium.DRAM, Medium.HBM]


@pytest.fixture
def plat(spec):
    p = build(spec)
    yield p
    p.close()


def put(plat, buf, data: np.ndarray, offset: int = 0) -> None:
    host = plat.alloc(data.nbytes, Medium.DRAM)
    host.numpy()[:] = data
    plat.copy(buf.at(offset, data.nbytes), host)
    plat.free(host)


def get(plat, buf, offset: int = 0, n: int | None = None) -> np.ndarray:
    n = buf.nbytes - offset if n is None else n
    host = plat.alloc(n, Medium.DRAM)
    plat.copy(host, buf.at(offset, n))
    out = host.numpy().copy()
    plat.free(host)
    return out


@pytest.mark.parametrize("medium", MEDIA)
@pytest.mark.parametrize("shareable", [False, True])
def test_alloc_write_read_free(plat, medium, shareable):
    buf = plat.alloc(1 << 16, medium, shareable=shareable)
    assert buf.nbytes == 1 << 16 and buf.medium is medium and buf.kind is BufferKind.OWNED
    data = pattern(1 << 16, 1)
    put(plat, buf, data)
    assert np.array_equal(get(plat, buf), data)
    plat.free(buf)
    assert buf.freed and buf not in plat.buffers()


def test_alloc_rejects_bad_arguments(plat):
    for bad in (0, -1):
        with pytest.raises(ValueError, match="nbytes"):
            plat.alloc(bad)
    for bad in (1.5, True, "4096"):
        with pytest.raises(TypeError, match="nbytes"):
            plat.alloc(bad)
    with pytest.raises(ValueError, match="medium"):
        plat.alloc(64, "gpu")


def test_free_twice_and_use_after_free(plat):
    buf = plat.alloc(64, Medium.DRAM)
    plat.free(buf)
    with pytest.raises(ValueError, match="freed"):
        plat.free(buf)
    with pytest.raises(ValueError, match="freed"):
        buf.at(0, 8)
    other = plat.alloc(64, Medium.DRAM)
    with pytest.raises(ValueError, match="freed"):
        plat.copy(other, buf)


@pytest.mark.parametrize("dst_m,src_m", list(product(MEDIA, MEDIA)))
def test_copy_every_direction_bit_exact(plat, dst_m, src_m):
    n = 3 * 4096 + 7
    src, dst = plat.alloc(n, src_m), plat.alloc(n, dst_m)
    data = pattern(n, 2)
    put(plat, src, data)
    put(plat, dst, np.zeros(n, np.uint8))
    plat.copy(dst, src)
    assert np.array_equal(get(plat, dst), data)


def test_copy_spans_leave_the_rest_untouched(plat):
    a, b = plat.alloc(10000, Medium.HBM), plat.alloc(10000, Medium.HBM)
    put(plat, a, pattern(10000, 3))
    put(plat, b, np.full(10000, 0xEE, np.uint8))
    plat.copy(b.at(5000, 1234), a.at(17, 1234))
    got, want = get(plat, b), np.full(10000, 0xEE, np.uint8)
    want[5000:6234] = pattern(10000, 3)[17:1251]
    assert np.array_equal(got, want)


def test_copy_rejects_bad_arguments(plat):
    a, b = plat.alloc(100, Medium.DRAM), plat.alloc(50, Medium.HBM)
    with pytest.raises(ValueError, match="does not fit"):
        plat.copy(b, a)
    with pytest.raises(ValueError, match="does not fit"):
        plat.copy(a, b, nbytes=60)
    with pytest.raises(ValueError, match="nbytes"):
        plat.copy(a, b, nbytes=0)
    with pytest.raises(ValueError, match="overlap"):
        plat.copy(a.at(10, 20), a.at(0, 20))
    with pytest.raises(ValueError, match="outside"):
        a.at(90, 20)
    with pytest.raises(TypeError, match="Buffer or Span"):
        plat.copy(a.ptr, b)
    other = build("sim")
    try:
        foreign = other.alloc(10, Medium.DRAM)
        with pytest.raises(ValueError, match="another platform"):
            plat.copy(a, foreign, nbytes=10)
    finally:
        other.close()


def test_batch_copy_scattered_pieces(plat):
    rng = np.random.default_rng(4)
    src, dst = plat.alloc(1 << 20, Medium.DRAM), plat.alloc(1 << 20, Medium.HBM)
    data = pattern(1 << 20, 5)
    put(plat, src, data)
    put(plat, dst, np.zeros(1 << 20, np.uint8))
    sizes = rng.integers(1, 8192, 100)
    dst_off = np.cumsum(np.r_[0, sizes[:-1]])  # packed, non-overlapping destinations
    src_off = rng.integers(0, (1 << 20) - 8192, 100)
    plat.batch_copy(CopyBatch(dst.ptr + dst_off, src.ptr + src_off, sizes))
    got, want = get(plat, dst), np.zeros(1 << 20, np.uint8)
    for d, s, n in zip(dst_off, src_off, sizes):
        want[d : d + n] = data[s : s + n]
    assert np.array_equal(got, want)
    # tuples of spans and buffers work too, and an empty batch is a no-op
    plat.batch_copy([(dst.at(0, 16), src.at(100, 16), 16), (dst.at(16, 8), src, 8)])
    plat.batch_copy([])
    assert np.array_equal(get(plat, dst, 0, 24), np.r_[data[100:116], data[:8]])


def test_batch_copy_rejects_stray_range_and_copies_nothing(plat):
    src, dst = plat.alloc(4096, Medium.DRAM), plat.alloc(4096, Medium.HBM)
    put(plat, src, pattern(4096, 6))
    put(plat, dst, np.zeros(4096, np.uint8))
    good = (dst.ptr, src.ptr, 100)
    with pytest.raises(ValueError, match="batch item 1: src"):
        plat.batch_copy([good, (dst.ptr + 200, src.ptr + 4000, 200)])
    with pytest.raises(ValueError, match="batch item 1: dst"):
        plat.batch_copy([good, (dst.ptr + 4095, src.ptr, 2)])
    with pytest.raises(ValueError, match="differ in length"):
        CopyBatch(np.zeros(2, int), np.zeros(3, int), np.zeros(2, int))
    with pytest.raises(ValueError, match="non-negative integers"):
        CopyBatch(np.zeros(2), np.zeros(2), np.zeros(2))
    with pytest.raises(ValueError, match="nbytes must be > 0"):
        plat.batch_copy([(dst.ptr, src.ptr, 0)])
    assert not get(plat, dst).any()


def test_stream_runs_copies_in_order(plat):
    n = 1 << 18
    a, b, c = (plat.alloc(n, m) for m in (Medium.DRAM, Medium.HBM, Medium.DRAM))
    put(plat, a, pattern(n, 7))
    put(plat, c, np.zeros(n, np.uint8))
    s = plat.stream()
    plat.copy(b, a, stream=s)
    plat.copy(c, b, stream=s)
    s.synchronize()
    assert s.query()
    assert np.array_equal(c.numpy(), pattern(n, 7))
    s.close()
    with pytest.raises(ValueError, match="closed"):
        plat.copy(c, b, stream=s)


def _copy_ordered_by_event(plat, seed, record):
    """DRAM -> HBM on one stream, then HBM -> DRAM on a second stream that waits only on
    ``record(plat, first_stream)``'s event: the second copy must see the first's bytes."""
    n = 1 << 18
    a, b, c = (plat.alloc(n, m) for m in (Medium.DRAM, Medium.HBM, Medium.DRAM))
    put(plat, a, pattern(n, seed))
    put(plat, c, np.zeros(n, np.uint8))
    s1, s2 = plat.stream(), plat.stream()
    plat.copy(b, a, stream=s1)
    ev = record(plat, s1)
    s2.wait_event(ev)
    plat.copy(c, b, stream=s2)
    s2.synchronize()
    assert np.array_equal(c.numpy(), pattern(n, seed))
    ev.synchronize()
    assert ev.query()


def test_event_orders_two_streams(plat):
    ev = plat.event()
    assert ev.query()  # never recorded: complete

    def record(plat, stream):
        ev.record(stream)
        return ev

    _copy_ordered_by_event(plat, 8, record)


def test_record_external_orders_a_stream_it_did_not_make(plat):
    """An event recorded through a raw stream handle orders a platform stream after it."""
    if not plat.supports_external_streams:
        with pytest.raises(NotImplementedError):
            plat.record_external(0)
        assert plat.framework_stream() is None
        return
    # the first stream stands in for a framework's stream
    _copy_ordered_by_event(plat, 9, lambda plat, stream: plat.record_external(stream.handle))
    with pytest.raises(TypeError, match="raw stream handle"):
        plat.record_external(None)


def test_platform_on_another_device_index(spec):
    """A platform built for a device index binds it (the runtime's current device, the
    buffers' device); a device that does not exist is refused."""
    from kvfabric.platform import registry

    name = spec.split("-")[0]
    cls = registry.platform_class(name)
    make = cls
    if spec.endswith("-fake"):
        from fake_runtime import HostRuntime

        count = 2

        def make(device):
            return cls(device=device, runtime=HostRuntime(devices=count))
    elif name == "sim":
        count = 2  # sim has no device limit
    else:
        if "-" in spec:
            pytest.skip(f"{spec} is a single-device fake")
        probe = build(spec)
        count = len(probe.info().devices)
        probe.close()
    if count < 2:
        pytest.skip(f"{name} sees {count} device(s); device 1 needs two")
    with make(device=1) as p:
        assert p.device == 1 and repr(p).endswith(":1)")
        assert getattr(getattr(p, "runtime", None), "device", 1) == 1
        buf = p.alloc(4096, Medium.HBM)
        assert buf.device == 1
        put(p, buf, pattern(4096, 10))
        assert np.array_equal(get(p, buf), pattern(4096, 10))
    if name != "sim":
        with pytest.raises(ValueError, match="does not exist"):
            make(device=count)
    with pytest.raises(ValueError, match="device must be an index"):
        make(device=-1)


def test_failed_copy_is_reported_on_synchronize(plat):
    a, b = plat.alloc(4096, Medium.DRAM), plat.alloc(4096, Medium.HBM)
    s = plat.stream()
    inject_copy_failure(plat)
    plat.copy(b, a, stream=s)
    with pytest.raises(TransferFailed):
        s.synchronize()
    plat.copy(b, a, stream=s)  # the stream goes on; the error was reported once
    s.synchronize()
    inject_copy_failure(plat)
    with pytest.raises(KVFabricError):
        plat.copy(b, a)


@pytest.mark.parametrize("medium", MEDIA)
def test_export_import_in_one_process(plat, medium):
    buf = plat.alloc(8192, medium, shareable=True)
    put(plat, buf, pattern(8192, 9))
    mapped = plat.import_handle(plat.export_handle(buf))
    assert mapped.kind is BufferKind.IMPORTED and mapped.ptr != buf.ptr
    assert np.array_equal(get(plat, mapped), pattern(8192, 9))
    put(plat, mapped, pattern(8192, 10))
    assert np.array_equal(get(plat, buf), pattern(8192, 10))
    plat.free(mapped)
    plat.free(buf)


def test_export_and_import_reject_bad_input(plat):
    private = plat.alloc(64, Medium.HBM)
    with pytest.raises(ValueError, match="shareable"):
        plat.export_handle(private)
    with pytest.raises(HandleError):
        plat.import_handle(b"\x00garbage")
    with pytest.raises(TypeError):
        plat.import_handle("not bytes")
    foreign = handles.encode("elsewhere", Medium.HBM, 64, os.getpid(), 0, b"x")
    with pytest.raises(HandleError, match="elsewhere"):
        plat.import_handle(foreign)
    shared = plat.alloc(64, Medium.DRAM, shareable=True)
    h = plat.export_handle(shared)
    plat.free(shared)
    with pytest.raises(KVFabricError):
        plat.import_handle(h)  # the owner freed it: clear error, no mapping of stale memory


@pytest.mark.parametrize("medium", MEDIA)
def test_ipc_across_processes(plat, spec, medium):
    n = 1 << 20
    buf = plat.alloc(n, medium, shareable=True)
    put(plat, buf, pattern(n, 11))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    env = {k: v for k, v in os.environ.items() if k.startswith("KVFABRIC_")}
    proc = ctx.Process(target=child_write_and_digest, args=(child, spec, plat.export_handle(buf), 12, env))
    proc.start()
    assert parent.poll(60), "child did not answer"
    status, digest = parent.recv()
    proc.join(30)
    assert status == "ok", digest
    assert digest == hashlib.sha256(pattern(n, 11).tobytes()).hexdigest()
    assert np.array_equal(get(plat, buf), pattern(n, 12))


def test_register_host_memory(plat):
    arr = np.zeros(1 << 16, np.uint8)
    reg = plat.register_host(arr.ctypes.data, arr.nbytes)
    assert reg.kind is BufferKind.REGISTERED
    dev = plat.alloc(1 << 16, Medium.HBM)
    put(plat, dev, pattern(1 << 16, 13))
    plat.copy(reg, dev)
    assert np.array_equal(arr, pattern(1 << 16, 13))
    assert plat.find(arr.ctypes.data + 10, 5).buffer is reg
    plat.free(reg)
    with pytest.raises(ValueError, match="not inside any live buffer"):
        plat.find(arr.ctypes.data, 1)
    with pytest.raises(ValueError, match="positive address"):
        plat.register_host(0, 10)


def test_wrap_numpy_and_cpu_tensor(plat):
    import torch

    arr = pattern(4096, 14).copy()
    t = torch.zeros(1024, dtype=torch.float32)
    a, b = plat.wrap(arr), plat.wrap(t)
    assert a.kind is BufferKind.WRAPPED and a.medium is Medium.DRAM and b.nbytes == 4096
    plat.copy(b, a)
    assert np.array_equal(t.numpy().view(np.uint8), arr)
    with pytest.raises(ValueError, match="contiguous"):
        plat.wrap(np.zeros((8, 8))[:, 1])
    with pytest.raises(TypeError):
        plat.wrap([1, 2, 3])
    with pytest.raises(ValueError, match="overlaps"):
        plat.wrap(arr)  # already known


def test_host_views_alias_memory(plat):
    import torch

    buf = plat.alloc(64, Medium.DRAM)
    view = buf.numpy()
    view[:] = 5
    t = buf.tensor(torch.int32)
    assert t.shape == (16,) and int(t[0]) == 0x05050505
    t[1] = 0
    assert not view[4:8].any()


def test_threads_copy_concurrently(plat):
    errors = []

    def worker(seed):
        try:
            a, b = plat.alloc(1 << 16, Medium.DRAM), plat.alloc(1 << 16, Medium.HBM)
            s = plat.stream()
            for i in range(20):
                put(plat, a, pattern(1 << 16, seed * 100 + i))
                plat.copy(b, a, stream=s)
                s.synchronize()
                assert np.array_equal(get(plat, b), pattern(1 << 16, seed * 100 + i))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_close_releases_everything(spec, isolated_shm):
    p = build(spec)
    p.alloc(4096, Medium.DRAM, shareable=True)
    p.alloc(4096, Medium.HBM, shareable=True)
    p.alloc(4096, Medium.HBM)
    p.import_handle(p.export_handle(p.alloc(4096, Medium.HBM, shareable=True)))
    p.stream()
    p.close()
    assert p.buffers() == []
    assert not [n for n in os.listdir(isolated_shm) if n.startswith("kvf.")]
    with pytest.raises(ValueError, match="closed"):
        p.alloc(10)
    p.close()  # idempotent


def test_info_names_the_devices(plat):
    info = plat.info()
    assert info.name == plat.name and info.devices and info.supports_ipc


def test_named_buffers_outlive_their_mapping(plat, spec, isolated_shm):
    buf, created = plat.alloc_named("contract-test", 8192)
    assert created and buf.medium is Medium.DRAM and buf.shareable
    put(plat, buf, pattern(8192, 21))
    mapped = plat.import_handle(plat.export_handle(buf))
    plat.free(buf)
    plat.free(mapped)
    again, created = plat.alloc_named("contract-test", 8192)
    assert not created
    assert np.array_equal(get(plat, again), pattern(8192, 21))
    with pytest.raises(KVFabricError, match="exists with 8192 B"):
        plat.alloc_named("contract-test", 4096)
    with pytest.raises(ValueError, match="segment name"):
        plat.alloc_named("bad/name", 64)
    plat.free(again)
    assert plat.unlink_named("contract-test") and not plat.unlink_named("contract-test")
