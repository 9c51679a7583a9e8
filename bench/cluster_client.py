"""A client process of ``kvfabric bench cluster``: one "node"'s pool client, driven by the host.

Started by :mod:`kvfabric.bench.cluster_host` inside the benchmark's network namespace,
in the UTS namespace and shared-memory directory of its node. It connects to the pool's
elected leader through etcd (``--window BYTES``: with a window of its own, where its puts
land; 0: a client without one, for the cross-node figures) and answers one JSON command
per line on stdin with one line ``MARK`` + JSON on stdout (``{"ok": ...}`` or
``{"error": ...}``). ``--mooncake``: instead of the pool, a Mooncake Store client that
contributes no memory (only ``bw`` is answered).

Objects: block ``b`` of prefix ``p`` of case ``c`` is key ``c/p<p>/b<b>``, its bytes
:func:`content` of the key (deterministic, so every client knows what a key must hold);
every read is hashed and compared with the hash of that content: a read that returned
bytes of another content is a *dirty read*, a hit only when they match.

Commands (``cmd``): ``rank``; ``replicas`` (copies of every put from now on); ``clear``
(empty the pool); ``warm`` (put every block of ``prefixes``); ``sweep`` (read
every prefix's blocks once in a shuffled order, counting hits, misses, dirty reads and
the longest call; ``reput``: put the blocks that missed, as a connector would);
``loop_start`` / ``loop_stop`` (sweeps without reput plus one put of a fresh key per
prefix, in a thread, until stopped: the calls made across a failover; ``mark`` notes the
kill's time, after which the first accepted put is recorded); ``new`` (put
fresh keys until each is accepted or ``timeout_s``); ``check`` (read given keys);
``bw`` (cross-node put and get throughput to ``peer_rank``'s window).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

MARK = "kvfabric-cluster: "


def content(key: str, nbytes: int) -> bytes:
    """The bytes object ``key`` holds: a pseudo-random stream seeded by the key."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def block_keys(case: str, prefix: int, blocks: int) -> list[str]:
    return [f"{case}/p{prefix}/b{b}" for b in range(blocks)]


@dataclass
class Tally:
    """What a run of reads saw (block reads; a batch call counts each of its blocks)."""

    lookups: int = 0
    hits: int = 0
    dirty: int = 0
    unavailable: int = 0  # calls that found no leader in time (their blocks count as misses)
    calls: int = 0
    max_call_s: float = 0.0
    puts: int = 0
    puts_ok: int = 0
    first_put_ok_after: float = 0.0  # wall time of the first accepted put after ``mark``
    mark: float = 0.0

    def merge_call(self, seconds: float) -> None:
        self.calls += 1
        self.max_call_s = max(self.max_call_s, seconds)


class Node:
    """The pool side of a client process."""

    def __init__(self, etcd: str, pool: str, token: str, window: int) -> None:
        from kvfabric.pool import connect

        self.c = connect(etcd=etcd, name=pool, token=token, window_bytes=window, timeout=1.0)
        self._expected: dict[str, bytes] = {}
        self._loop: threading.Thread | None = None
        self._stop = threading.Event()
        self._tally = Tally()
        self._lock = threading.Lock()
        self.copies: int | None = None  # replicas of every put (None: the pool's)

    def expected(self, key: str, nbytes: int) -> bytes:
        d = self._expected.get(key)
        if d is None:
            d = self._expected[key] = digest(content(key, nbytes))
        return d

    # -------------------------------------------------------------- calls, timed
    def _timed(self, tally: Tally, fn: Any, *args: Any) -> Any:
        from kvfabric.errors import ServiceUnavailable

        t0 = time.monotonic()
        try:
            return fn(*args)
        except ServiceUnavailable:
            tally.unavailable += 1
            return None
        finally:
            tally.merge_call(time.monotonic() - t0)

    def _read(self, tally: Tally, keys: list[str], nbytes: int) -> list[str]:
        """Read ``keys``; count; return the keys that missed."""
        got = self._timed(tally, self.c.batch_get, keys)
        tally.lookups += len(keys)
        if got is None:
            return list(keys)
        missed = []
        for k, v in zip(keys, got, strict=True):
            if v is None:
                missed.append(k)
            elif digest(v) != self.expected(k, nbytes):
                tally.dirty += 1
                missed.append(k)
            else:
                tally.hits += 1
        return missed

    def _put(self, tally: Tally, keys: list[str], nbytes: int) -> int:
        from kvfabric.pool.status import Status

        st = self._timed(tally, self.c.batch_put, keys, [content(k, nbytes) for k in keys], self.copies)
        tally.puts += len(keys)
        ok = 0 if st is None else sum(1 for s in st if s in (Status.OK, Status.EXISTS))
        tally.puts_ok += ok
        if ok and tally.mark and not tally.first_put_ok_after and time.time() > tally.mark:
            tally.first_put_ok_after = time.time()
        return ok

    # -------------------------------------------------------------- commands
    def rank(self) -> int:
        return int(self.c.session.rank if self.c.session.rank is not None else -1)

    def replicas(self, n: int) -> bool:
        """Every put from now on asks for ``n`` copies."""
        self.copies = int(n)
        return True

    def clear(self) -> int:
        """Empty the pool (between runs)."""
        return self.c.remove_all()

    def warm(self, case: str, prefixes: list[int], blocks: int, size: int) -> dict[str, Any]:
        t = Tally()
        for p in prefixes:
            self._put(t, block_keys(case, p, blocks), size)
        return asdict(t)

    def sweep(
        self, case: str, prefixes: list[int], blocks: int, size: int, seed: int, reput: bool
    ) -> dict[str, Any]:
        t = Tally()
        self._sweep(t, case, prefixes, blocks, size, seed, reput)
        return asdict(t)

    def _sweep(
        self, t: Tally, case: str, prefixes: list[int], blocks: int, size: int, seed: int, reput: bool
    ) -> None:
        order = list(prefixes)
        random.Random(seed).shuffle(order)
        for p in order:
            missed = self._read(t, block_keys(case, p, blocks), size)
            if reput and missed:
                self._put(t, missed, size)

    def loop_start(self, case: str, prefixes: list[int], blocks: int, size: int, seed: int) -> bool:
        self._stop.clear()
        self._tally = Tally()

        def body() -> None:
            i, rng = 0, random.Random(seed)
            while not self._stop.is_set():
                p = rng.choice(prefixes)
                self._read(self._tally, block_keys(case, p, blocks), size)
                i += 1
                self._put(self._tally, [f"{case}/loop/{os.getpid()}/{i}"], size)

        self._loop = threading.Thread(target=body, daemon=True)
        self._loop.start()
        return True

    def mark(self, t: float) -> bool:
        """From now on, note the first accepted put after wall time ``t`` (the kill)."""
        self._tally.mark = t
        return True

    def loop_stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._loop is not None:
            self._loop.join(30)
        return asdict(self._tally)

    def new(self, case: str, n: int, size: int, timeout_s: float) -> dict[str, Any]:
        t, t0 = Tally(), time.monotonic()
        keys = [f"{case}/new/{os.getpid()}/{i}" for i in range(n)]
        todo = list(keys)
        while todo and time.monotonic() - t0 < timeout_s:
            for k in list(todo):
                if self._put(t, [k], size):
                    todo.remove(k)
            if todo:
                time.sleep(0.1)
        return {"keys": keys, "accepted": n - len(todo), "s": round(time.monotonic() - t0, 3), **asdict(t)}

    def check(self, keys: list[str], size: int) -> dict[str, Any]:
        t = Tally()
        self._read(t, keys, size)
        return asdict(t)

    def bw(self, peer_rank: int, n: int, size: int, rounds: int) -> dict[str, Any]:
        """Cross-node figures: ``n`` objects of ``size`` bytes put into ``peer_rank``'s
        window (alloc there, write, commit) and read back (``batch_get_into``), ``rounds``
        times; medians of GB/s; every read's bytes compared."""
        from kvfabric.pool.status import Status

        src = np.frombuffer(bytearray(content("bw/src", n * size)), np.uint8)
        dst = np.zeros(n * size, np.uint8)
        self.c.register_buffer(src.ctypes.data, src.nbytes)
        self.c.register_buffer(dst.ctypes.data, dst.nbytes)
        ptrs = src.ctypes.data + np.arange(n, dtype=np.uint64) * np.uint64(size)
        dptrs = dst.ctypes.data + np.arange(n, dtype=np.uint64) * np.uint64(size)
        sizes = np.full(n, size, np.uint64)
        puts, gets, wrong, failed = [], [], 0, 0
        for r in range(rounds):
            keys = [f"bw/{os.getpid()}/{r}/{i}" for i in range(n)]
            t0 = time.perf_counter()
            st, gvas = self.c.batch_alloc(keys, [size] * n, preferred_rank=peer_rank)
            ok = [bool(s == Status.OK) for s in st]
            if all(ok):
                self.c.write(gvas, ptrs, sizes)
            self.c.batch_commit(keys, ok)
            t1 = time.perf_counter()
            failed += n - sum(ok)
            dst[:] = 0
            t2 = time.perf_counter()
            got = self.c.batch_get_into(keys, dptrs, sizes)
            t3 = time.perf_counter()
            failed += int(np.count_nonzero(got))
            wrong += int(not np.array_equal(src, dst))
            puts.append(n * size / (t1 - t0) / 1e9)
            gets.append(n * size / (t3 - t2) / 1e9)
            self.c.batch_remove(keys)
        placed = [int(g) for g in gvas[:1]]
        return {
            "put_gbps": round(statistics.median(puts), 3),
            "get_gbps": round(statistics.median(gets), 3),
            "failed": int(failed),
            "wrong_rounds": int(wrong),
            "first_gva_rank": int(self.c.session.addr.decode(placed[0])[1]) if placed else -1,
        }


class MooncakeNode:
    """A Mooncake Store client contributing no memory (the store process owns it)."""

    def __init__(self) -> None:
        from kvfabric.bench.stores.mooncake import setup_store

        self.s = setup_store(0)

    def bw(self, peer_rank: int, n: int, size: int, rounds: int) -> dict[str, Any]:
        src = np.frombuffer(bytearray(content("bw/src", n * size)), np.uint8)
        dst = np.zeros(n * size, np.uint8)
        for a in (src, dst):
            rc = self.s.register_buffer(a.ctypes.data, a.nbytes)
            if rc != 0:
                raise RuntimeError(f"Mooncake register_buffer failed with code {rc}")
        ptrs = [src.ctypes.data + i * size for i in range(n)]
        dptrs = [dst.ctypes.data + i * size for i in range(n)]
        puts, gets, wrong, failed = [], [], 0, 0
        for r in range(rounds):
            keys = [f"bw/{os.getpid()}/{r}/{i}" for i in range(n)]
            t0 = time.perf_counter()
            rc = self.s.batch_put_from(keys, ptrs, [size] * n)
            t1 = time.perf_counter()
            failed += sum(1 for c in rc if c != 0)
            dst[:] = 0
            t2 = time.perf_counter()
            got = self.s.batch_get_into(keys, dptrs, [size] * n)
            t3 = time.perf_counter()
            failed += sum(1 for c in got if c != size)
            wrong += int(not np.array_equal(src, dst))
            puts.append(n * size / (t1 - t0) / 1e9)
            gets.append(n * size / (t3 - t2) / 1e9)
            self.s.batch_remove(keys, True)
        return {
            "put_gbps": round(statistics.median(puts), 3),
            "get_gbps": round(statistics.median(gets), 3),
            "failed": int(failed),
            "wrong_rounds": int(wrong),
        }


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--etcd", default="")
    ap.add_argument("--pool", default="")
    ap.add_argument("--token", default="")
    ap.add_argument("--window", type=int, default=0)
    ap.add_argument("--mooncake", action="store_true")
    a = ap.parse_args()
    try:
        node: Any = MooncakeNode() if a.mooncake else Node(a.etcd, a.pool, a.token, a.window)
    except Exception as e:  # noqa: BLE001 - reported to the host
        _reply({"error": f"{type(e).__name__}: {e}"})
        return
    _reply({"ok": os.getpid()})
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg.pop("cmd")
        if cmd == "stop":
            break
        try:
            _reply({"ok": getattr(node, cmd)(**msg)})
        except Exception as e:  # noqa: BLE001 - reported to the host
            _reply({"error": f"{cmd}: {type(e).__name__}: {e}"})
    if not a.mooncake:
        node.c.close()


if __name__ == "__main__":
    main()
