"""Binary pool keys: ``KeyBatch`` checked once a batch, the service's check of raw requests,
the readable rendering of listings, and the pool store's keys built from the id array."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvfabric.platform.types import Medium
from kvfabric.pool import protocol as p
from kvfabric.pool import table as tbl
from kvfabric.pool.config import PoolConfig
from kvfabric.pool.keys import (
    MAX_KEY_BYTES,
    RESERVED_PREFIX,
    KeyBatch,
    check_keys,
    encode_key,
    encode_keys,
    key_from_text,
    key_text,
)
from kvfabric.pool.service.dispatch import Dispatcher
from kvfabric.pool.service.fence import FENCE_PREFIX
from kvfabric.pool.service.meta import MetaService
from kvfabric.pool.status import Status
from kvfabric.pool.windows import FixedStride
from kvfabric.ucm_layer.store.pool import object_keys

KiB = 1024


@pytest.fixture
def dispatcher():
    view = tbl.create(256)
    svc = MetaService(PoolConfig(dram=0, max_objects=256), view, FixedStride())
    svc.add_window(0, Medium.DRAM, 100 * KiB)
    yield Dispatcher(svc, epoch=7, info={})
    view.close()
    view.seg.unlink()


def test_a_key_batch_is_its_prefix_ids_and_suffix():
    ids = np.arange(48, dtype=np.uint8).reshape(3, 16)
    batch = KeyBatch.of_ids(b"kv/", ids, b"\x00\x05")
    assert len(batch) == 3 and batch.width == 3 + 16 + 2
    assert batch[1] == b"kv/" + bytes(range(16, 32)) + b"\x00\x05"
    assert encode_keys(batch) == [b"kv/" + ids[i].tobytes() + b"\x00\x05" for i in range(3)]
    assert not batch.matrix.flags.writeable
    both = KeyBatch.stack([batch, KeyBatch(batch.matrix[:1])])
    assert both.tolist() == batch.tolist() + batch.tolist()[:1]
    assert KeyBatch.of_ids(b"kv/", np.zeros((0, 16), np.uint8)).tolist() == []


@pytest.mark.parametrize(
    "build,match",
    [
        (
            lambda: KeyBatch.of_ids(b"kv/", [[1] * 16, [1] * 15 + [300]]),
            r"ids\[1, 15\] = 300: must be a byte",
        ),
        (lambda: KeyBatch.of_ids(b"kv/", np.zeros((4, 15), np.uint8)), r"ids must be an \(n, 16\)"),
        (lambda: KeyBatch.of_ids(b"kv/", np.zeros((2, 16), np.float32)), "got an array of float32"),
        (lambda: KeyBatch(np.zeros((2, MAX_KEY_BYTES + 1), np.uint8)), "keys of 257 bytes"),
        (lambda: KeyBatch(np.zeros((2, 0), np.uint8)), "keys of 0 bytes"),
        (lambda: KeyBatch(np.zeros(5, np.uint8)), r"an \(n, width\) uint8 matrix"),
        (lambda: KeyBatch.of_ids(RESERVED_PREFIX, np.zeros((2, 16), np.uint8)), r"ids\[0\]: .*reserved"),
        (lambda: encode_keys(["a", "ok", b"x" * 300]), r"keys\[2\]: pool key of 300 bytes"),
        (lambda: encode_keys(["a", 5]), r"keys\[1\]: pool keys are str or bytes, got int"),
        (lambda: encode_key("\ud800"), "has no UTF-8 form"),
    ],
)
def test_a_bad_batch_names_its_first_bad_index(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()


def test_keys_are_any_bytes_but_the_reserved_prefix():
    assert FENCE_PREFIX.startswith(RESERVED_PREFIX)  # the service's tombstones stay apart
    check_keys([b"\xff", b"\x00" * MAX_KEY_BYTES, b"a\x00\xff\xfe"])
    assert encode_key(b"\x80\x00") == b"\x80\x00" and encode_key("é") == "é".encode()
    with pytest.raises(ValueError, match=r"keys\[1\]: .*reserved"):
        check_keys([b"ok", FENCE_PREFIX + b"1"])
    with pytest.raises(ValueError, match="reserved"):  # a client refuses it before any RPC
        encode_key(RESERVED_PREFIX + b"x")


def test_the_service_refuses_a_bad_raw_request_whole(dispatcher):
    raw = {"type": "alloc", "client": "c", "keys": [b"\x01good", b"\xff\xfebad"], "sizes": [KiB, KiB]}
    reply = dispatcher.handle(p.decode_request(msgspec.msgpack.encode(raw)))
    assert reply.error.startswith("alloc: keys[1]:") and "reserved" in reply.error
    assert reply.status == [] and dispatcher.service.table.count == 0
    with pytest.raises(msgspec.ValidationError, match=r"\$\.keys\[0\]"):  # the decoder's bound
        p.decode_request(msgspec.msgpack.encode({"type": "exists", "keys": [b""]}))
    reply = dispatcher.handle(p.Exists([b"ok", "text"]))  # an in-process caller skipping checks
    assert reply.error == "exists: keys[1]: pool keys are bytes on the wire, got str"


def test_binary_keys_are_stored_and_listed_readably(dispatcher):
    keys = object_keys("kv", np.array([[0xAB] * 16, [0x5C] + [0x41] * 15], np.uint8), 1)
    st = dispatcher.handle(p.Alloc("c", keys.tolist(), [KiB, KiB])).status
    assert st == [Status.OK, Status.OK]
    assert dispatcher.handle(p.Commit("c", keys.tolist(), [True, True])).status == [Status.OK, Status.OK]
    assert dispatcher.handle(p.Exists(keys.tolist())).flags == [True, True]
    listed = dispatcher.handle(p.ListKeys(b"kv/")).data["keys"]
    assert listed == sorted(key_text(k) for k in keys.tolist())
    assert listed[0] == "kv/\\\\" + "A" * 15 + "\\x00\\x01" and listed[1].startswith("kv/\\xab\\xab")
    assert [key_from_text(t) for t in listed] == sorted(keys.tolist())


def test_key_text_round_trips_every_byte():
    raw = bytes(range(256))
    assert key_from_text(key_text(raw)) == raw
    assert key_text("kv/plain-é".encode()) == "kv/plain-é"
    with pytest.raises(ValueError, match="bad escape"):
        key_from_text("kv/\\q")


def test_pool_store_keys_are_built_from_the_id_array():
    ids = np.random.default_rng(0).integers(0, 256, (5, 16), dtype=np.uint8)
    keys = object_keys("kv", ids, 300)
    assert keys.width == len("kv/") + 16 + 2
    assert keys[4] == b"kv/" + ids[4].tobytes() + (300).to_bytes(2, "big")
    with pytest.raises(ValueError, match="shard must be an int"):
        object_keys("kv", ids, 1 << 16)
