"""A peer that stops answering mid-pool: reads from it must give up in time, untorn.

Run inside a loopback-only network namespace (``netns.run_isolated``). This process is
node A (``remote_read_timeout`` TIMEOUT); a spawned worker is node B. After a first read
that works, B is frozen (SIGSTOP: still a member, its engine accepts connections and
answers nothing). A's reads of B's window must fail within the bound with the
destination as it was, then fail at once while B is suspect. B then resumes, so the read
given up completes, into A's staging: the destination must still be untouched after that,
and a new read must bring B's bytes. Prints one JSON object with what was seen.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from gva_worker import Worker, pattern

from kvfabric.errors import TransferFailed
from kvfabric.pool.gva.config import GvaConfig
from kvfabric.pool.gva.fabric import Fabric
from kvfabric.pool.gva.rendezvous.peer import ProcState, process_state
from kvfabric.pool.gva.rendezvous.server import RendezvousServer
from kvfabric.status import ItemStatus

WIN = 4 << 20
PIECE = 1 << 20
TIMEOUT = 0.5
REMOTE = ("mapped", "remote")
SENTINEL = 0xA5


def timed_read(a: Fabric, dst: object, src: int, n: int) -> tuple[float, str]:
    t0 = time.monotonic()
    try:
        a.xcopy_sync(dst, src, n)
        outcome = "ok"
    except TransferFailed as e:
        outcome = f"{type(e).__name__}: {e}"
    return round(time.monotonic() - t0, 3), outcome


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads is stopped: ``kill`` returns
    before a thread running on the other core stops, and a read sent in that moment is served."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = [process_state(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]  # a thread's stat
        if all(st in (ProcState.STOPPED, ProcState.DEAD) for st in states):  # DEAD: a thread that exited
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"pid {pid} did not stop within {timeout} s: thread states {states}")
        time.sleep(0.001)


def main() -> None:
    out: dict[str, object] = {"timeout": TIMEOUT}
    cfg = GvaConfig(node="node-a", transports=REMOTE, remote_read_timeout=TIMEOUT, remote_suspect_time=60)
    with RendezvousServer() as srv:
        b = Worker.start(srv.url, {"dram": WIN}, node="node-b", transports=REMOTE)
        a = Fabric.join(srv.url, "sim", {"dram": WIN}, config=cfg)
        stopped = False
        try:
            a.wait_for(lambda t: len(t.members) == 2, 30)
            plat = a.platform
            remote = a.transport("remote")
            gb = a.gva("dram", 0, rank=b.rank)
            want = pattern(WIN, b.rank)
            dst = plat.alloc(WIN, "dram")
            view = dst.numpy()
            view[:] = 0
            out["first_read"] = timed_read(a, dst, gb, PIECE)[1]
            out["first_bytes_ok"] = bool((view[:PIECE] == want[:PIECE]).all())
            view[:] = SENTINEL
            stopped = True
            freeze(b.proc.pid)
            # the single piece (copy_one) and the batch path (what the pool's reads use)
            out["stalled_s"], out["stalled"] = timed_read(a, dst, gb + PIECE, PIECE)
            out["untouched_after_stall"] = bool((view == SENTINEL).all())
            out["suspect_s"], out["suspect"] = timed_read(a, dst, gb + 2 * PIECE, PIECE)
            items = [(dst.ptr + k * 65536, gb + 3 * PIECE + k * 65536, 65536) for k in range(3)]
            t0 = time.monotonic()
            st = a.batch_xcopy(items, inline=True).wait(5)
            out["batch_s"] = round(time.monotonic() - t0, 3)
            out["batch_failed"] = bool((st == ItemStatus.FAILED).all())
            # B resumes: the read given up lands in staging, never in dst
            os.kill(b.proc.pid, signal.SIGCONT)
            stopped = False
            t0 = time.monotonic()
            while remote.poll_given_up() and time.monotonic() - t0 < 10:
                time.sleep(0.02)
            out["given_up_final_s"] = round(time.monotonic() - t0, 3)
            out["given_up_left"] = remote.poll_given_up()
            out["untouched_after_resume"] = bool((view == SENTINEL).all())
            route = a.table.member(b.rank).routes["mooncake"]
            out["suspect_cleared"] = remote.suspect(route) is None
            out["read_after_resume"] = timed_read(a, dst, gb + PIECE, PIECE)[1]
            out["bytes_after_resume_ok"] = bool((view[:PIECE] == want[PIECE : 2 * PIECE]).all())
        finally:
            if stopped:
                os.kill(b.proc.pid, signal.SIGCONT)
            a.leave()
            b.stop()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
