"""Which process is at the other end of a rendezvous connection, and is it still alive?

The single-node server (``server.py``) asks this before it drops a session that went
silent: a process whose threads cannot get the GIL (a long C call holds it) or a CPU
(the machine is loaded) sends nothing, yet it is alive and must keep its ephemeral keys.
The kernel can tell such a process from a hung one without its help:

* ``peer_pid(sock, claimed)``: the pid behind a connection. A Unix socket names it
  (``SO_PEERCRED``). Over TCP the client claims a pid in its ``hello``; it is believed
  only when that process holds the client end of this very connection (the socket inode
  that ``/proc/net/tcp`` lists for the peer address is among ``/proc/<pid>/fd``), which
  also rules out a client on another host or in another network namespace. ``None``:
  unknown (the caller then has no proof of life and must fall back to silence alone).
* ``process_state(pid)``: the state letter of ``/proc/<pid>/stat`` as a ``ProcState``.

Both only read ``/proc``; they never signal or stop anything. Linux only (elsewhere
every answer is "unknown").
"""

from __future__ import annotations

import enum
import os
import socket
import struct
from typing import Any

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class ProcState(enum.Enum):
    """What ``/proc/<pid>/stat`` says about a process."""

    RUNNING = "running"  # R: on a CPU or waiting for one (a CPU-starved process is here)
    SLEEPING = "sleeping"  # S, I: waiting for an event (a lock, a socket, a timer)
    DISK = "disk"  # D: inside the kernel (I/O, page faults)
    STOPPED = "stopped"  # T, t: SIGSTOP or a debugger; it cannot answer until continued
    DEAD = "dead"  # Z, X, or no such process
    UNKNOWN = "unknown"  # no pid, or /proc cannot be read

    @property
    def alive(self) -> bool:
        """True when the process can still run by itself (it may just be slow)."""
        return self in (ProcState.RUNNING, ProcState.SLEEPING, ProcState.DISK)


_LETTERS = {
    "R": ProcState.RUNNING,
    "S": ProcState.SLEEPING,
    "I": ProcState.SLEEPING,
    "D": ProcState.DISK,
    "T": ProcState.STOPPED,
    "t": ProcState.STOPPED,
    "Z": ProcState.DEAD,
    "X": ProcState.DEAD,
    "x": ProcState.DEAD,
}


def process_state(pid: int | None) -> ProcState:
    """The state of process ``pid`` (``UNKNOWN`` for ``None`` or an unreadable ``/proc``)."""
    if pid is None or pid <= 0:
        return ProcState.UNKNOWN
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return ProcState.DEAD
    except OSError:
        return ProcState.UNKNOWN
    try:
        letter = data[data.rindex(b")") + 2 :].split(maxsplit=1)[0].decode("ascii")
    except (ValueError, IndexError, UnicodeDecodeError):
        return ProcState.UNKNOWN
    return _LETTERS.get(letter, ProcState.UNKNOWN)


def _tcp_hex(host: str, port: int) -> str | None:
    """``host:port`` as ``/proc/net/tcp`` writes a local IPv4 address (``0100007F:1F90``)."""
    try:
        packed = socket.inet_aton(host)
    except OSError:
        return None
    return f"{struct.unpack('=I', packed)[0]:08X}:{port:04X}"


def _tcp_inode(local: str, remote: str) -> int | None:
    """The inode of the socket whose local/remote addresses are these (hex form)."""
    try:
        with open("/proc/net/tcp") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) > 9 and parts[1] == local and parts[2] == remote:
            return int(parts[9]) or None
    return None


def _holds(pid: int, inode: int) -> bool:
    want = f"socket:[{inode}]"
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"{fd_dir}/{fd}") == want:
                return True
        except OSError:
            continue
    return False


def peer_pid(sock: Any, claimed: int | None) -> int | None:
    """The pid at the other end of ``sock`` (a socket, or asyncio's wrapper of one; see the
    module docstring), or ``None``."""
    if sock is None:
        return None
    try:
        family = sock.family
        if family == socket.AF_UNIX and hasattr(socket, "SO_PEERCRED"):
            pid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
            return pid if pid > 0 else None
        if family != socket.AF_INET or claimed is None or claimed <= 0:
            return None
        peer_host, peer_port = sock.getpeername()[:2]
        my_host, my_port = sock.getsockname()[:2]
    except OSError:
        return None
    local, remote = _tcp_hex(peer_host, peer_port), _tcp_hex(my_host, my_port)
    if local is None or remote is None:
        return None
    inode = _tcp_inode(local, remote)  # the client's end, seen from this network namespace
    return claimed if inode is not None and _holds(claimed, inode) else None
