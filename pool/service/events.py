"""The pool daemon's KV events: what its directory stores and drops, in vLLM's schema over ZMQ.

Turned on by ``kv_events_endpoint`` (``PoolConfig``; off by default); the node starts a
:class:`KvEventPublisher` once it serves and stops it first when it closes. Consumers
(routers, ``kvfabric.pool.kv_events.Subscriber``) see what vLLM's ``ZmqEventPublisher``
sends, so vLLM's subscriber examples and the routers built on them work unchanged:

* PUB on ``kv_events_endpoint`` (always bound; ``tcp://HOST:0`` picks a free port, and the
  daemon's ready line and ``/health`` name the bound ``kv_events_endpoint``): per batch the
  frames ``topic`` (``kv_events_topic``), the sequence number (8 bytes big endian, 0 for the
  first batch of each publisher start, then +1 per batch) and the msgpack ``KVEventBatch``
  (``kvfabric.pool.kv_events``: what the fields mean, what the block hash is);
* ROUTER on ``kv_events_replay_endpoint`` (optional): a request ``[b"", start_seq]`` is
  answered with each of the last ``kv_events_buffer`` batches from ``start_seq`` on, as
  ``[b"", topic, seq, payload]``, and the end marker ``[b"", b"", -1 (8 bytes, signed), b""]``.
  (A request without the empty frame is answered without it.)

What is announced (the hooks in ``MetaService``): ``BlockStored`` when objects become
READABLE (``commit``; ``reregister`` after a restart); ``BlockRemoved`` when a READABLE
object leaves the directory: evicted (LRU between the watermarks, or for a directory slot),
removed, TTL-expired, refused as corrupt and removed by its reader, or dropped with its
rank (a client that leaves or dies, on whatever node, takes its window's blocks along);
``AllBlocksCleared`` for ``remove_all``. Writes that never became readable (abandoned,
fenced) are never announced.

**Every publisher start begins with a snapshot**: ``AllBlocksCleared``, then ``BlockStored``
of every readable object, so the stream alone rebuilds the directory (a restarted daemon's
re-entered objects included) and a subscriber that sees sequence 0 starts over.

Off the RPC path: a hook appends the keys and addresses of one call to an in-memory queue
(a lock held for the append, nothing else; the queue's first item of a round also writes
one byte to a pipe that wakes the publisher). The publisher thread gathers what comes
within ``FLUSH_S`` (5 ms) of its last round (a wake-up per commit would keep taking the
interpreter from the RPC threads), then takes the queue whole,
turns it into events (consecutive objects of one window share an event; at most
``BATCH_HASHES`` hashes a batch), encodes, sends and keeps each batch for replay; it owns
both sockets. PUB never blocks (past its high-water mark, 100 000 messages, ZMQ drops for
that slow subscriber, who sees the gap). When more than ``kv_events_queue`` keys wait for
the thread, the hook drops what it is given and every later item until the thread has
caught up (``kvfabric_pool_kv_events_dropped``); the thread then publishes a new snapshot
(``AllBlocksCleared`` + the directory, taken under the service lock with the queue emptied
in the same critical section), so subscribers are right again without asking.

Metrics (``/metrics``): ``kvfabric_pool_kv_events_published`` (block hashes announced, and
clears), ``kvfabric_pool_kv_event_batches`` (batches sent; the last sequence number is this
minus one), ``kvfabric_pool_kv_events_dropped``, ``kvfabric_pool_kv_event_snapshots``,
``kvfabric_pool_kv_event_replays`` (replay requests served).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvfabric.platform.types import Medium
from kvfabric.pool import kv_events as ke
from kvfabric.pool.table import SlotState, TableView

log = logging.getLogger("kvfabric.pool.events")

BATCH_HASHES = 1024  # block hashes per batch at most (a batch of 18-byte ids: ~30 KB)
FLUSH_S = 0.005  # a round of events gathers what the service reports within 5 ms of the last
PUB_HWM = 100_000  # ZMQ messages queued per subscriber before ZMQ drops for it
STORED, REMOVED, CLEARED = 0, 1, 2


class EventQueue:
    """What the meta service tells the publisher (see module docstring).

    ``stored`` / ``removed`` / ``cleared`` are called by the service (one thread at a time,
    under its dispatcher's lock); each appends one item and never blocks on anything but
    the queue's own lock. The lists passed in are kept: the caller must not change them
    afterwards. ``take`` (the publisher thread) empties the queue and returns its items;
    ``restart`` (the publisher, under the service lock) replaces it with a snapshot."""

    def __init__(self, limit: int, wake_fd: int = -1) -> None:
        self.limit = limit
        self._wake_fd = wake_fd
        self._lock = threading.Lock()
        self._items: deque[tuple[int, list[bytes], list[int]]] = deque()
        self._pending = 0  # keys in _items
        self.lost = False  # dropped since the last restart: the publisher resyncs
        self.dropped = 0  # keys dropped so far

    def stored(self, keys: list[bytes], gvas: list[int]) -> None:
        self._put(STORED, keys, gvas)

    def removed(self, keys: list[bytes], gvas: list[int]) -> None:
        self._put(REMOVED, keys, gvas)

    def cleared(self) -> None:
        self._put(CLEARED, [], [])

    def _put(self, kind: int, keys: list[bytes], gvas: list[int]) -> None:
        n = len(keys)
        with self._lock:
            if self.lost or self._pending + n > self.limit:
                if not self.lost:
                    self.lost = True
                    self._wake()
                self.dropped += max(n, 1)
                return
            first = not self._items
            self._items.append((kind, keys, gvas))
            self._pending += n
        if first:
            self._wake()

    def _wake(self) -> None:
        if self._wake_fd >= 0:
            try:
                os.write(self._wake_fd, b"\0")
            except (BlockingIOError, OSError):
                pass  # the pipe is full of wake-ups already (or closed: stopping)

    def take(self) -> list[tuple[int, list[bytes], list[int]]]:
        with self._lock:
            items, self._items, self._pending = list(self._items), deque(), 0
        return items

    def restart(self, items: list[tuple[int, list[bytes], list[int]]]) -> None:
        """Replace what waits with ``items`` (a snapshot: taken under the service lock, so
        nothing queued before it is needed) and clear ``lost``. A snapshot does not count
        toward ``limit`` (a directory larger than it must not drop every later event)."""
        with self._lock:
            self._items = deque(items)
            self._pending = 0
            self.lost = False
        self._wake()

    def prepend(self, items: list[tuple[int, list[bytes], list[int]]]) -> None:
        """Put ``items`` before what waits (the publisher thread, the only taker, after a
        ``restart([])``: the snapshot it took then goes ahead of what came after it)."""
        with self._lock:
            self._items.extendleft(reversed(items))


Readable = tuple[np.ndarray, np.ndarray, np.ndarray, bytes]  # key offsets, lengths, gvas, arena


def readable_arrays(view: TableView) -> Readable:
    """What names every readable object: array copies only (no Python per object), so the
    service lock is held for a memcpy of the table; call under it. ``readable_objects``
    makes keys of them after letting go."""
    live = view.slots[view.slots["state"] == SlotState.READABLE]
    arena = bytes(view.arena[: int(view.hdr["arena_used"][0])])
    return live["key_off"].astype(np.int64), live["key_len"].astype(np.int64), live["gva"].copy(), arena


def readable_objects(arrays: Readable) -> tuple[list[bytes], list[int]]:
    """Keys and addresses of ``readable_arrays``."""
    offs, lens, gvas, arena = arrays
    keys = [arena[o : o + n] for o, n in zip(offs.tolist(), lens.tolist(), strict=True)]
    return keys, gvas.tolist()


@dataclass(frozen=True)
class Where:
    """The event fields of one window: vLLM's medium, locality and the tier name."""

    medium: str
    locality: str
    ownership: str


def _bindable(endpoint: str) -> str:
    """``tcp://HOST:0`` as ZMQ's ``tcp://HOST:*`` (a free port)."""
    return endpoint[:-2] + ":*" if endpoint.startswith("tcp://") and endpoint.endswith(":0") else endpoint


class KvEventPublisher:
    """The ZMQ publisher of one pool node (see module docstring).

    Call order: construct, ``start()`` (binds both sockets in the publisher thread and
    raises what binding raised; then, under ``lock``, queues the snapshot and installs the
    queue into the service), ``stop()`` (uninstalls the queue, publishes what is queued,
    closes the sockets; idempotent; also after a failed ``start()``). ``config``: the
    pool's (its ``name`` and ``kv_events_*`` keys); ``lock``: the dispatcher's lock (the
    service's single-thread contract); ``view``: the directory table; ``install(queue |
    None)``: puts the queue into the service (called under ``lock``); ``decode(gva) ->
    (medium, rank, offset)``: the pool's addressing; ``node_of(rank)``: the node a rank runs
    on now (None when it has left); ``node``: this node. The thread owns both sockets; the
    replay buffer holds the encoded payloads (bytes the publisher owns)."""

    def __init__(
        self,
        config: Any,
        lock: threading.Lock,
        view: TableView,
        install: Callable[[EventQueue | None], None],
        decode: Callable[[int], tuple[Medium, int, int]],
        node_of: Callable[[int], str | None],
        node: str,
    ) -> None:
        self.pool = config.name
        self.endpoint: str = config.kv_events_endpoint
        self.replay_endpoint: str | None = config.kv_events_replay_endpoint or None
        self.topic = config.kv_events_topic.encode()
        self._lock, self._view, self._install = lock, view, install
        self._decode, self._node_of, self._node = decode, node_of, node
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        os.set_blocking(self._rfd, False)
        self.queue = EventQueue(config.kv_events_queue, self._wfd)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.kv_events_buffer)
        self._seq = 0
        self._last_node: dict[int, str] = {}
        self.counts = {"published": 0, "batches": 0, "snapshots": 0, "replays": 0}
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvfabric-pool-events", daemon=True)
        self._started = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._started = True
        self._thread.start()
        self._bound.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        self._snapshot(install=True)
        log.info(
            "pool %r publishes KV events on %s%s",
            self.pool,
            self.endpoint,
            f" (replay on {self.replay_endpoint})" if self.replay_endpoint else "",
        )

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._started and self._error is None:
            with self._lock:
                self._install(None)
        try:
            os.write(self._wfd, b"\0")
        except OSError:
            pass
        if self._started:
            self._thread.join(5)
        if self._thread.is_alive():
            return  # stuck in a send: leave it its pipe rather than close fds under it
        self.queue._wake_fd = -1
        for fd in (self._rfd, self._wfd):
            try:
                os.close(fd)
            except OSError:
                pass

    def metrics(self) -> dict[str, int]:
        """The publisher's counters (``/metrics``), plus keys dropped from the queue."""
        return {**self.counts, "dropped": self.queue.dropped}

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        pub = replay = None
        try:
            try:
                pub = ctx.socket(zmq.PUB)
                pub.setsockopt(zmq.SNDHWM, PUB_HWM)
                pub.bind(_bindable(self.endpoint))
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
                if self.replay_endpoint is not None:
                    replay = ctx.socket(zmq.ROUTER)
                    replay.bind(_bindable(self.replay_endpoint))
                    self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            except zmq.ZMQError as e:  # handed to start(): a port in use, a bad address
                where = f"{self.endpoint!r}" + (
                    f" / {self.replay_endpoint!r}" if self.replay_endpoint else ""
                )
                self._error = OSError(f"kv_events: cannot bind {where}: {e}")
                return
            finally:
                self._bound.set()
            poller = zmq.Poller()
            poller.register(self._rfd, zmq.POLLIN)
            if replay is not None:
                poller.register(replay, zmq.POLLIN)
            flushed = 0.0
            while not self._stop.is_set():
                ready = dict(poller.poll(500))
                try:
                    if replay is not None and replay in ready:
                        self._serve_replay(replay, zmq)
                    if self._rfd not in ready:
                        continue
                    # gather what comes within FLUSH_S of the last batch into one round
                    # (a wake-up per commit would cost the RPC threads the interpreter)
                    hold = flushed + FLUSH_S - time.monotonic()
                    if hold > 0 and not self.queue.lost:
                        if replay is not None and replay.poll(hold * 1000, zmq.POLLIN):
                            self._serve_replay(replay, zmq)
                        elif replay is None:
                            self._stop.wait(hold)
                    try:
                        while os.read(self._rfd, 4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                    if self.queue.lost:
                        self._snapshot()
                    self._publish(pub, self.queue.take())
                    flushed = time.monotonic()
                except Exception:  # a bad cycle must not end the stream
                    log.exception("publishing KV events failed")
                    time.sleep(0.1)
            self._publish(pub, self.queue.take())  # what the service said before stop()
        finally:
            for s in (pub, replay):
                if s is not None:
                    s.close(linger=200)
            ctx.term()

    def _snapshot(self, install: bool = False) -> None:
        """Queue ``AllBlocksCleared`` + every readable object in place of what waits, the
        table copied and the queue emptied in one critical section with the service.
        ``install`` (``start()``, before the thread publishes anything): the queue goes
        into the service in that section too, keys made under the lock. Otherwise (the
        thread, after a drop) the keys are made after letting go and put ahead of what
        the service queued since: only this thread takes from the queue."""
        with self._lock:
            if self._stop.is_set():
                return  # stop() has uninstalled the queue: nothing to resync
            arrays = readable_arrays(self._view)
            if install:
                keys, gvas = readable_objects(arrays)
                self.queue.restart([(CLEARED, [], []), (STORED, keys, gvas)])
                self._install(self.queue)
            else:
                self.queue.restart([])
        if not install:
            keys, gvas = readable_objects(arrays)
            self.queue.prepend([(CLEARED, [], []), (STORED, keys, gvas)])
        self.counts["snapshots"] += 1

    def _where(self, gva: int, cache: dict[tuple[Medium, int], Where]) -> Where:
        medium, rank, _ = self._decode(gva)
        hit = cache.get((medium, rank))
        if hit is None:
            node = self._node_of(rank)
            if node is None:
                node = self._last_node.get(rank)  # it left: where it was
            else:
                self._last_node[rank] = node
            loc = ke.Locality.LOCAL if node is None or node == self._node else ke.Locality.REMOTE
            hit = cache[(medium, rank)] = Where(
                ke.MEDIUM.get(medium, ke.MEDIUM_CPU), loc.value, ke.ownership(self.pool, rank, node)
            )
        return hit

    def _publish(self, pub: Any, items: list[tuple[int, list[bytes], list[int]]]) -> None:
        """Events of ``items``, in order, sent as batches of at most ``BATCH_HASHES``."""
        if not items:
            return
        cache: dict[tuple[Medium, int], Where] = {}
        events: list[ke.Event] = []
        size = 0
        run: tuple[int, Where] | None = None
        hashes: list[bytes] = []

        def close_run() -> None:
            nonlocal run, hashes
            if run is not None and hashes:
                kind, w = run
                make = ke.stored if kind == STORED else ke.removed
                events.append(make(hashes, w.medium, w.locality, w.ownership))
            run, hashes = None, []

        for kind, keys, gvas in items:
            if kind == CLEARED:
                close_run()
                events.append(ke.AllBlocksCleared())
                size += 1
                continue
            for key, gva in zip(keys, gvas):
                w = self._where(gva, cache)
                if run is None or run[0] != kind or run[1] is not w:
                    close_run()
                    run = (kind, w)
                hashes.append(key)
                size += 1
                if size >= BATCH_HASHES:
                    close_run()
                    self._send(pub, events, size)
                    events, size = [], 0
        close_run()
        if events:
            self._send(pub, events, size)

    def _send(self, pub: Any, events: list[ke.Event], size: int) -> None:
        payload = ke.encode_batch(ke.KVEventBatch(ts=time.time(), events=events))
        seq = self._seq
        pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self._seq += 1
        self.counts["batches"] += 1
        self.counts["published"] += size

    def _serve_replay(self, sock: Any, zmq: Any) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) == 3 and frames[1] == b"":
                envelope = [frames[0], b""]
            elif len(frames) == 2:
                envelope = [frames[0]]
            else:
                log.warning("kv_events replay: ignored a request of %d frames", len(frames))
                continue
            start_b = frames[-1]
            if len(start_b) != 8:
                log.warning("kv_events replay: the start sequence is 8 bytes, got %d", len(start_b))
                continue
            start = int.from_bytes(start_b, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    sock.send_multipart([*envelope, self.topic, seq.to_bytes(8, "big"), payload])
            sock.send_multipart([*envelope, b"", ke.END_SEQ, b""])
            self.counts["replays"] += 1
