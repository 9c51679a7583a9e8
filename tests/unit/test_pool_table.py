"""The shared directory table: single-writer updates, lock-free readers (C)."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.errors import OutOfSpace
from kvfabric.pool import table as tbl
from kvfabric.pool.service.table_writer import TableWriter
from kvfabric.pool.table import SlotState, TableRetired


@pytest.fixture
def writer():
    view = tbl.create(64, avg_key_bytes=16)
    yield TableWriter(view)
    view.close()
    view.seg.unlink()


def test_insert_find_remove(writer):
    slot, existed = writer.insert(b"alpha", 1000, 10, 7, SlotState.ALLOCATED)
    assert not existed
    assert writer.insert(b"alpha", 5, 5, 5, SlotState.READABLE) == (slot, True)
    hit = writer.view.lookup(b"alpha")
    assert (hit.gva, hit.size, hit.gen, hit.state) == (1000, 10, 7, SlotState.ALLOCATED)
    writer.set_state(slot, SlotState.READABLE)
    assert writer.view.lookup(b"alpha").state is SlotState.READABLE
    assert writer.view.lookup(b"beta") is None
    writer.remove(slot)
    assert writer.view.lookup(b"alpha") is None and writer.count == 0


def test_full_table_and_arena(writer):
    for i in range(writer.capacity):
        writer.insert(f"k{i}".encode(), i, 1, 1, SlotState.READABLE)
    with pytest.raises(OutOfSpace, match="directory table full"):
        writer.insert(b"one-more", 0, 1, 1, SlotState.READABLE)


def test_arena_compaction_keeps_every_key():
    view = tbl.create(24, avg_key_bytes=8)  # a 4 KiB arena
    w = TableWriter(view)
    try:
        for round_ in range(40):  # churn far more key bytes than the arena holds
            keys = [f"round{round_}-key{i}-{'x' * 60}".encode() for i in range(5)]
            for i, k in enumerate(keys):
                w.insert(k, i, 1, 1, SlotState.READABLE)
            for k in keys[:4]:
                w.remove(view.lookup(k).slot)
            assert view.lookup(keys[4]).gva == 4
            if round_ % 2:
                w.remove(view.lookup(keys[4]).slot)
        survivors = [f"round{r}-key4-{'x' * 60}".encode() for r in range(0, 40, 2)]
        assert w.count == len(survivors) and all(view.lookup(k) for k in survivors)
    finally:
        view.close()
        view.seg.unlink()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=300))
def test_matches_a_dict_under_random_churn(ops):
    view = tbl.create(64, avg_key_bytes=16)
    w = TableWriter(view)
    ref: dict[bytes, int] = {}
    try:
        for add, k in ops:
            key = f"key-{k}".encode()
            if add and key not in ref and len(ref) < w.capacity:
                w.insert(key, 1000 + k, k + 1, k, SlotState.READABLE)
                ref[key] = 1000 + k
            elif not add and key in ref:
                w.remove(view.lookup(key).slot)
                del ref[key]
        for k in range(41):
            key = f"key-{k}".encode()
            hit = view.lookup(key)
            assert (hit.gva if hit else None) == ref.get(key)
        idx, out = view.lookup_many([f"key-{k}".encode() for k in range(41)])
        assert [int(out[i, 1]) if idx[i] >= 0 else None for i in range(41)] == [
            ref.get(f"key-{k}".encode()) for k in range(41)
        ]
        assert w.count == len(ref)
    finally:
        view.close()
        view.seg.unlink()


def _reader(name: str, nbytes: int, ready, stop, result) -> None:
    view = tbl.attach(name, nbytes)
    ready.set()
    seen = bad = 0
    while not stop.is_set():
        for k in range(64):
            key = f"key-{k}".encode()
            hit = view.lookup(key)
            if hit is None:
                continue
            seen += 1
            # the writer always stores gva = 1000 * k + gen and size = gen for key k
            if hit.gva != 1000 * k + hit.gen or hit.size != hit.gen:
                bad += 1
    result.put((seen, bad))
    view.close()


def test_readers_in_another_process_never_see_a_torn_slot():
    view = tbl.create(48, avg_key_bytes=8)
    w = TableWriter(view)
    ctx = mp.get_context("spawn")
    ready, stop, result = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_reader, args=(view.seg.name, view.seg.nbytes, ready, stop, result))
    proc.start()
    assert ready.wait(60)
    rng = np.random.default_rng(0)
    gen = 0
    try:
        for _ in range(4000):
            k = int(rng.integers(0, 64))
            key = f"key-{k}".encode()
            hit = view.lookup(key)
            if hit is None and w.count < w.capacity:
                gen += 1
                w.insert(key, 1000 * k + gen, gen, gen, SlotState.READABLE)
            elif hit is not None:
                if rng.random() < 0.5:
                    w.remove(hit.slot)
                else:
                    gen += 1
                    w.update(hit.slot, gva=1000 * k + gen, size=gen, gen=gen)
        stop.set()
        seen, bad = result.get(timeout=60)
        proc.join(30)
        assert seen > 0 and bad == 0
    finally:
        stop.set()
        proc.join(5)
        view.close()
        view.seg.unlink()


def test_retired_tables_refuse_readers(writer):
    writer.insert(b"k", 1, 1, 1, SlotState.READABLE)
    hit = writer.view.lookup(b"k")
    other = tbl.attach(writer.view.seg.name, writer.view.seg.nbytes)
    other.retire()
    with pytest.raises(TableRetired):
        writer.view.lookup(b"k")
    assert writer.view.seq_now(hit.slot) != hit.seq  # a copy in flight is discarded
    other.close()
    assert os.path.exists(writer.view.seg.path)
