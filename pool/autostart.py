"""A node-local pool daemon started on demand, shared by every process that asks for it.

The vLLM connector's default with no ``pool_address``, when an engine spans several
processes (docs/vllm.md): every process of the engine, and every other engine on the node
configured alike, calls :func:`ensure` with the same :class:`AutoPool` and gets the socket
of one daemon (``kvfabric pool serve``).

Call order and locking: :func:`ensure` takes an exclusive ``flock`` on
``<socket>.start.lock`` (blocking, bounded by ``start_timeout_s``), then probes the socket
(an ``Info`` call). A daemon that answers is joined. Otherwise this process starts one as
a detached subprocess (its own session: a signal to the caller's process group, e.g.
Ctrl-C or a worker restart, does not reach it; stdin closed; stdout and stderr appended to
``<socket>.log``) and waits until it answers, or until it exits (``PoolStartFailed`` with
the tail of its log). The lock is released only then, so of any number of processes racing
exactly one starts a daemon and the others find it ready. The daemon's own locks
(``daemon.py``) still guard against a daemon started by hand on the same socket or name.
The daemon is not a child of the caller: it runs under a subshell that outlives the
caller's tree and logs its exit status, so killing the caller's process tree (as vLLM does
to an engine core that does not stop in time) leaves it running.

Lifetime: the daemon is started with ``exit_when_idle_s`` (default 30 s), so it exits, and
removes its segments and socket, once no client has been connected for that long: it goes
away with its last client and survives a client restart shorter than the grace. ``0``
keeps it until SIGTERM. Its subshell reaps it.

Where: ``<runtime dir>/kvfabric-pool-<name>.sock``; the runtime dir is
``$XDG_RUNTIME_DIR`` (as for ``kvfabric pool serve``'s default socket) or, without it,
``<tmp>/kvfabric-<uid>`` (made 0700; refused if another user owns it). The daemon's
platform is the caller's (``KVFABRIC_PLATFORM`` in its environment), since clients must
run the pool's platform.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from kvfabric.errors import KVFabricError, ServiceUnavailable
from kvfabric.pool.service.lock import AlreadyRunning, PidLock

log = logging.getLogger("kvfabric.pool.autostart")

PROBE_TIMEOUT_S = 1.0
POLL_S = 0.05
LOG_TAIL_BYTES = 4000


class PoolStartFailed(KVFabricError):
    """The daemon this process started exited or did not answer in time; the message has
    its command and the end of its log."""


@dataclass(frozen=True)
class AutoPool:
    """What to ensure: a daemon of pool ``name`` with ``dram`` bytes at ``socket`` (``""``:
    :func:`socket_path` of the name) that exits after ``exit_when_idle_s`` without clients
    (0: never), on ``platform`` (None: the caller's default)."""

    name: str = "default"
    dram: int = 4 << 30
    exit_when_idle_s: float = 30.0
    platform: str | None = None
    socket: str = ""
    start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in "/ \0"):
            raise ValueError(f"pool name {self.name!r}: a non-empty name without '/' or spaces")
        if self.dram < 0 or self.exit_when_idle_s < 0 or self.start_timeout_s <= 0:
            raise ValueError(
                f"pool autostart: dram ({self.dram}) and exit_when_idle_s ({self.exit_when_idle_s}) "
                f"must be >= 0, start_timeout_s ({self.start_timeout_s}) > 0"
            )

    @property
    def path(self) -> str:
        return self.socket or socket_path(self.name)


@dataclass(frozen=True)
class PoolLocation:
    """The daemon :func:`ensure` found or started: its socket, its pid (from its socket
    lock, None if unreadable) and whether this call started it."""

    socket: str
    pid: int | None
    started: bool


def runtime_dir() -> str:
    """This user's directory for pool sockets (see module docstring)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return xdg
    d = os.path.join(tempfile.gettempdir(), f"kvfabric-{os.getuid()}")
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PoolStartFailed(
            f"{d} is not a directory of this user (uid {os.getuid()}); set XDG_RUNTIME_DIR "
            "or the connector's pool_address"
        )
    return d


def socket_path(name: str) -> str:
    return os.path.join(runtime_dir(), f"kvfabric-pool-{name}.sock")


def probe(socket: str, timeout: float = PROBE_TIMEOUT_S) -> dict[str, Any] | None:
    """The ``Info`` of the daemon at ``socket``, or None if nothing answers there."""
    from kvfabric.pool import protocol as p
    from kvfabric.pool.client.rpc import SocketTransport

    t = SocketTransport(socket, timeout=timeout)
    try:
        return dict(t.call(p.Info()).data)
    except ServiceUnavailable:
        return None
    finally:
        t.close()


def daemon_pid(socket: str) -> int | None:
    """The pid the daemon at ``socket`` wrote into its socket lock."""
    try:
        with open(f"{socket}.lock") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def ensure(pool: AutoPool) -> PoolLocation:
    """The daemon of ``pool``, started by this call if none answers (see module docstring)."""
    sock = pool.path
    deadline = time.monotonic() + pool.start_timeout_s
    lock = _lock(f"{sock}.start.lock", deadline)
    try:
        info = probe(sock)
        if info is not None:
            _check(pool, sock, info)
            return PoolLocation(sock, daemon_pid(sock), started=False)
        proc = _spawn(pool, sock)
        while True:
            info = probe(sock)
            if info is not None:
                _check(pool, sock, info)
                pid = daemon_pid(sock)
                if pid is not None and pid != proc.pid:  # one started by hand meanwhile won
                    return PoolLocation(sock, pid, started=False)
                log.debug(
                    "kvfabric: started the node's pool daemon %r (pid %d, %d MiB, socket %s, exits "
                    "%s; log %s.log)",
                    pool.name,
                    proc.pid,
                    pool.dram >> 20,
                    sock,
                    f"{pool.exit_when_idle_s:g} s after its last client"
                    if pool.exit_when_idle_s
                    else "on SIGTERM only",
                    sock,
                )
                return PoolLocation(sock, proc.pid, started=True)
            if not proc.running():
                status = proc.status()
                raise PoolStartFailed(
                    f"the pool daemon started for {sock} exited"
                    + (f" with status {status}" if status is not None else "")
                    + f": {_tail(sock)}"
                )
            if time.monotonic() > deadline:
                proc.kill()
                raise PoolStartFailed(
                    f"the pool daemon started for {sock} did not answer within {pool.start_timeout_s:g} s: "
                    f"{_tail(sock)}"
                )
            time.sleep(POLL_S)
    finally:
        lock.release()


def _lock(path: str, deadline: float) -> PidLock:
    while True:
        try:
            return PidLock.acquire(path, "a kvfabric process", f"is starting the pool daemon ({path})")
        except AlreadyRunning as e:
            if time.monotonic() > deadline:
                raise PoolStartFailed(f"waited too long for the pool daemon's start: {e}") from e
            time.sleep(POLL_S)


def _check(pool: AutoPool, sock: str, info: dict[str, Any]) -> None:
    if info.get("name") != pool.name:
        raise PoolStartFailed(f"the daemon at {sock} serves pool {info.get('name')!r}, not {pool.name!r}")
    if pool.platform and info.get("platform") != pool.platform:
        raise PoolStartFailed(
            f"the pool daemon at {sock} runs on platform {info.get('platform')!r}; this process uses "
            f"{pool.platform!r}: stop it, or name another pool (pool.name)"
        )


def command(pool: AutoPool, sock: str) -> list[str]:
    """The daemon's command line."""
    cmd = [sys.executable, "-m", "kvfabric.cli", "pool", "serve", "--name", pool.name]
    cmd += ["--dram", str(pool.dram), "--socket", sock]
    if pool.exit_when_idle_s:
        cmd += ["--exit-when-idle", f"{pool.exit_when_idle_s:g}"]
    return cmd


UNBIND_ENV = "KVFABRIC_POOL_UNBIND"


def unbind_cpus() -> set[int] | None:
    """Widen this process's CPU affinity to the node's (the CPUs the container's first
    process may use), as an auto-started daemon does at start; None when it cannot."""
    try:
        cpus = os.sched_getaffinity(1)
        os.sched_setaffinity(0, cpus)
    except (OSError, AttributeError):
        return None
    return cpus


def _spawn_env_marks_unbind(platform: str | None = None) -> dict[str, str]:
    """The environment of an auto-started daemon: this process's, its platform, INFO
    logs, and the mark that makes it drop the CPU binding it inherits (it serves the whole
    node; a vLLM CPU worker pins itself to its cores, and a daemon sharing them with the
    forward misses its RPC deadlines)."""
    env = dict(os.environ)
    if platform:
        env["KVFABRIC_PLATFORM"] = platform
    env.setdefault("KVFABRIC_LOG_LEVEL", "INFO")
    env[UNBIND_ENV] = "1"
    return env


# The daemon runs detached from its starter's process tree: a shell backgrounds a subshell
# (re-parented when the shell exits) that starts the daemon, prints its pid, waits for it and
# appends its exit status to the log. A starter whose tree is killed as one (vLLM kills an
# engine core's descendants when it does not stop within its shutdown timeout) thus does not
# take the node's daemon, which other engines may share, with it.
_DETACH = '( "$@" >&2 & echo $!; exec >&-; wait $!; echo "--- the pool daemon exited with status $?" >&2 ) &'
_EXIT_LINE = re.compile(rb"--- the pool daemon exited with status (\d+)")


@dataclass(frozen=True)
class _Daemon:
    """A daemon :func:`_spawn` started: its pid (not this process's child) and where its
    run's part of the log begins (earlier runs appended their own exit lines)."""

    pid: int
    sock: str
    log_from: int

    def running(self) -> bool:
        from kvfabric.pool.gva.rendezvous.peer import ProcState, process_state

        return process_state(self.pid) is not ProcState.DEAD  # a zombie counts as exited

    def status(self, wait_s: float = 1.0) -> int | None:
        """The exit status its subshell logged (None if not logged within ``wait_s``)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                with open(f"{self.sock}.log", "rb") as f:
                    f.seek(self.log_from)
                    found = _EXIT_LINE.findall(f.read())
            except OSError:
                found = []
            if found or time.monotonic() > deadline:
                return int(found[-1]) if found else None
            time.sleep(POLL_S)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _spawn(pool: AutoPool, sock: str) -> _Daemon:
    env = _spawn_env_marks_unbind(pool.platform)
    with open(f"{sock}.log", "ab") as out:
        out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} starts the daemon\n".encode())
        out.flush()
        log_from = out.tell()
        shell = subprocess.Popen(
            ["/bin/sh", "-c", _DETACH, "sh", *command(pool, sock)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=out,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
    assert shell.stdout is not None
    with shell.stdout:
        line = shell.stdout.readline().strip()
    shell.wait()
    if not line.isdigit():
        raise PoolStartFailed(f"could not start the pool daemon for {sock}: {_tail(sock)}")
    return _Daemon(int(line), sock, log_from)


def _tail(sock: str) -> str:
    try:
        with open(f"{sock}.log", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            return f.read().decode(errors="replace").strip() or "(its log is empty)"
    except OSError as e:
        return f"(no log: {e})"
