"""A late re-registration over reused space: after a daemon restart, a client's re-registration
of an object in its window arrives after the restarted meta service has handed that very
extent to another object. The service refuses the stale object, the new object keeps its
bytes, and the stale key is a miss (never the new object's bytes), then and after a later
restart."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from kvf_testing import segments
from pool_testing import Daemon, content

from kvfabric.errors import KeyNotFound, ServiceUnavailable
from kvfabric.platform.checksum import Verify
from kvfabric.pool import connect
from kvfabric.pool import protocol as p
from kvfabric.pool.client.api import PoolClient
from kvfabric.pool.status import Status

pytestmark = pytest.mark.sim

KiB, MiB = 1 << 10, 1 << 20
SIZE = 64 * KiB


@dataclass
class Reused:
    """The pool after the late re-registration: ``owner`` holds the stale object's window,
    ``other`` wrote ``fresh`` over the same extent; ``status``: the re-registration's reply."""

    tmp: Path
    daemon: Daemon
    owner: PoolClient
    other: PoolClient
    status: list[int]


def _restart(tmp: Path, d: Daemon, owner: PoolClient) -> Daemon:
    d.kill()  # SIGKILL: the directory is rebuilt from what clients re-register
    with pytest.raises(ServiceUnavailable):  # the client finds its service gone
        owner.refresh()
    return Daemon(tmp).start()  # same name and socket


@contextmanager
def reused_space(tmp: Path) -> Iterator[Reused]:
    d = Daemon(tmp).start()
    owner = connect(d.socket, window_bytes=2 * MiB)
    assert owner.put("stale", content("stale", SIZE)) is Status.OK
    gva = int(owner.table.lookup(b"stale").gva)
    assert owner.addr.decode(gva)[1] == owner.rank  # the object lies in the owner's own window
    d = _restart(tmp, d, owner)
    other = connect(d.socket)
    fresh = np.frombuffer(content("fresh", SIZE), np.uint8).copy()
    buf = other.register_buffer(int(fresh.ctypes.data), SIZE)
    seen: list[int] = []
    transport = owner.session.transport
    call = transport.call

    def late(req: object) -> p.Reply:
        if isinstance(req, p.Reregister):
            # the owner rejoined with its window; before its re-registration arrives the
            # service hands the same extent to another object, which is written and published
            st, gvas = other.batch_alloc(["fresh"], [SIZE], preferred_rank=owner.rank)
            assert list(st) == [Status.OK] and int(gvas[0]) == gva, (st, gvas, gva)
            other.write(gvas, [int(fresh.ctypes.data)], [SIZE])
            assert list(other.batch_commit(["fresh"])) == [Status.OK]
            reply = call(req)
            seen.extend(reply.status)
            return reply
        return call(req)

    state = Reused(tmp, d, owner, other, seen)
    transport.call = late  # type: ignore[method-assign]
    try:
        owner.refresh()  # sees the new epoch: rejoins, then re-registers its window's objects
        transport.call = call  # type: ignore[method-assign]
        other.unregister_buffer(buf)
        yield state
    finally:
        transport.call = call  # type: ignore[method-assign]
        state.other.close()
        owner.close()
        assert state.daemon.stop() == 0


def _is_a_miss(clients: tuple[PoolClient, ...]) -> None:
    for c in clients:
        assert not c.exists("stale")
        with pytest.raises(KeyNotFound):  # a miss, never the new object's bytes
            c.get("stale")


def test_a_late_reregistration_over_reused_space_is_refused_then_and_at_the_next_restart(
    tmp_path, isolated_shm
):
    with reused_space(tmp_path) as r:
        assert r.status == [Status.INVALID]  # the stale object is refused
        assert r.other.get("fresh") == content("fresh", SIZE)  # the new object keeps its bytes
        assert r.owner.get("fresh") == content("fresh", SIZE)
        _is_a_miss((r.owner, r.other))
        # the refused object is not re-registered at the next restart either, even once the
        # reused extent is free again with the other object's bytes still in it
        assert r.other.remove("fresh")
        r.daemon = _restart(tmp_path, r.daemon, r.owner)
        r.other.close()
        r.other = connect(r.daemon.socket)
        r.owner.refresh()
        for c in (r.owner, r.other):
            c.verify = Verify.OFF  # no checksum to catch it: the directory alone must be right
        _is_a_miss((r.owner, r.other))
    assert segments(isolated_shm) == []
