"""When a silent rendezvous session ends: the per-session state and the judgement on it.

The single-node server (``server.py``) keeps one ``Session`` per connection and, on every
tick of its loop, asks ``SilenceRules.judge`` what to do with it. The rules:

* *Any* frame counts as a sign of life (clients send a keep-alive every ``session_ttl / 3``
  and answer probes from their reader thread).
* After ``session_ttl`` of silence the session is probed; if nothing arrives within
  ``probe_grace`` the peer process itself is looked at (``peer.py``: its pid from
  ``SO_PEERCRED``, or the pid a TCP client claimed and whose process holds that
  connection): stopped (SIGSTOP), a zombie or gone ends the session (a hung process is
  noticed after ``session_ttl + probe_grace``); running, sleeping or in the kernel (starved
  of CPU, or its GIL held by a long C call) keeps it, probing again every ``probe_grace``,
  up to ``max_silence`` of silence in all. A peer whose process cannot be seen (another
  host, no ``/proc``) ends at ``session_ttl + probe_grace``.
* Time during which the server's own loop did not run (its process starved, or its GIL
  held by another thread) is not counted as anybody's silence: ``SilenceRules.late``
  measures how late a tick is and the loop credits every session with the delay.

Nothing here does I/O on the connection: the server sends the probes and closes the
sessions this module judges.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import Any

from kvfabric.pool.gva.rendezvous.peer import ProcState, peer_pid, process_state

log = logging.getLogger("kvfabric.gva.rendezvous")


class Liveness(enum.Enum):
    """Where a session stands in the server's judgement (see module docstring)."""

    TALKING = "talking"  # a frame arrived within session_ttl
    PROBED = "probed"  # silent past session_ttl: a probe was sent, waiting probe_grace
    KEPT = "kept"  # the probe went unanswered but the process is alive: probing again


class Verdict(enum.Enum):
    """What the server must do with a session after ``SilenceRules.judge``."""

    WAIT = "wait"  # nothing yet
    PROBE = "probe"  # send it a probe (the session is already marked as probed)
    DROP = "drop"  # end it


class Session:
    """One connection's liveness state (its ``writer`` and ``tasks`` belong to the server)."""

    __slots__ = (
        "claimed_pid",
        "id",
        "last_seen",
        "pid",
        "pid_known",
        "probed_at",
        "state",
        "tasks",
        "writer",
    )

    def __init__(self, sid: int, writer: asyncio.StreamWriter) -> None:
        self.id = sid
        self.writer = writer
        self.last_seen = time.monotonic()
        self.state = Liveness.TALKING
        self.probed_at = 0.0
        self.claimed_pid: int | None = None  # what a TCP client said in its hello
        self.pid: int | None = None
        self.pid_known = False  # pid resolved (to a number or to "cannot be seen")
        self.tasks: set[asyncio.Task[Any]] = set()

    def heard(self, now: float) -> Liveness:
        """A frame arrived: the session is talking again; returns the state it left."""
        was, self.state, self.last_seen = self.state, Liveness.TALKING, now
        return was

    def credit(self, seconds: float, now: float) -> None:
        """The server did not run for ``seconds``: do not count them as this peer's silence."""
        self.last_seen = min(now, self.last_seen + seconds)
        self.probed_at = min(now, self.probed_at + seconds)

    def probed(self, now: float) -> None:
        """A probe is being sent now."""
        self.state, self.probed_at = Liveness.PROBED, now

    def peer_state(self) -> ProcState:
        """The state of the peer process (its pid resolved once, on first need)."""
        if not self.pid_known:
            self.pid = peer_pid(self.writer.get_extra_info("socket"), self.claimed_pid)
            self.pid_known = True
        return process_state(self.pid)


class SilenceRules:
    """``session_ttl``, ``probe_grace`` and ``max_silence`` (validated), and the judgement."""

    def __init__(self, session_ttl: float, probe_grace: float | None, max_silence: float | None) -> None:
        if session_ttl <= 0:
            raise ValueError(f"session_ttl must be > 0 seconds, got {session_ttl}")
        self.session_ttl = float(session_ttl)
        self.probe_grace = max(1.0, self.session_ttl / 2) if probe_grace is None else float(probe_grace)
        if self.probe_grace <= 0:
            raise ValueError(f"probe_grace must be > 0 seconds, got {probe_grace}")
        self.max_silence = 6.0 * self.session_ttl if max_silence is None else float(max_silence)
        if self.max_silence < self.session_ttl + self.probe_grace:
            raise ValueError(
                f"max_silence ({self.max_silence} s) must be at least session_ttl + probe_grace "
                f"({self.session_ttl + self.probe_grace} s)"
            )
        self.tick = min(self.session_ttl / 4, self.probe_grace / 2, 1.0)  # seconds between judgements

    def late(self, elapsed: float) -> float:
        """Seconds a tick that came ``elapsed`` after the last one is late by, when that is
        enough to mean the loop did not run (credit them to every session and judge on a
        later tick, once the loop has caught up with its sockets); else 0."""
        late = elapsed - self.tick
        return late if late > self.tick / 2 else 0.0

    def judge(self, s: Session, now: float) -> Verdict:
        """What to do with session ``s`` at ``now`` (see module docstring)."""
        silent = now - s.last_seen
        if silent < self.session_ttl:
            return Verdict.WAIT
        if s.state is Liveness.TALKING:
            s.probed(now)
            return Verdict.PROBE
        if now - s.probed_at < self.probe_grace:
            return Verdict.WAIT
        state = s.peer_state()
        if state.alive and silent < self.max_silence:
            if s.state is Liveness.PROBED:
                log.warning(
                    "rendezvous session %d silent for %.1f s but its process %d is %s: kept "
                    "(up to %.0f s of silence)",
                    s.id,
                    silent,
                    s.pid,
                    state.value,
                    self.max_silence,
                )
            s.probed(now)
            s.state = Liveness.KEPT
            return Verdict.PROBE
        log.warning(
            "rendezvous session %d silent for %.1f s, probe unanswered, its process %s is %s: dropped",
            s.id,
            silent,
            s.pid if s.pid is not None else "(unknown)",
            state.value,
        )
        return Verdict.DROP
