"""Wire format of the single-node rendezvous store: length-prefixed msgpack frames.

A frame is a 4-byte big-endian length and a msgpack array. Requests are
``[id, op, *args]``; replies ``[id, True, result]`` or ``[id, False, [kind, message]]``
where ``kind`` names the exception the client re-raises. Replies may come out of order
(a blocking ``get``/``watch`` does not hold up the requests behind it).

Liveness frames (id 0, never answered): a client's keep-alive ``[0, "beat"]`` (sent by its
heartbeat thread, and by its reader thread in answer to a probe), and the server's probe
``[0, None, "probe"]``, sent to a session that has been silent for ``session_ttl``.

Addresses: ``kvf://HOST:PORT`` (TCP, 127.0.0.1 in tests) or ``kvf+unix:///PATH``.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from kvfabric.errors import KeyNotFound, ServiceUnavailable
from kvfabric.pool.gva.rendezvous.base import Compacted

HEADER = struct.Struct(">I")
MAX_FRAME = 64 << 20
ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder()

ERROR_KINDS: dict[str, type[Exception]] = {
    "KeyNotFound": KeyNotFound,
    "Compacted": Compacted,
    "ValueError": ValueError,
    "TypeError": TypeError,
    "ServiceUnavailable": ServiceUnavailable,
}


def frame(msg: Any) -> bytes:
    body = ENCODER.encode(msg)
    return HEADER.pack(len(body)) + body


BEAT_OP = "beat"
BEAT = frame([0, BEAT_OP])  # client -> server keep-alive
PROBE_TAG = "probe"
PROBE = frame([0, None, PROBE_TAG])  # server -> client: "are you alive?"


def error_kind(e: BaseException) -> str:
    for name, cls in ERROR_KINDS.items():
        if type(e) is cls:
            return name
    return "ServiceUnavailable"


def parse_address(url: str) -> tuple[str, str | int]:
    """``("tcp", (host, port))``-like split: ``("tcp", "host:port")`` or ``("unix", path)``."""
    if url.startswith("kvf+unix://"):
        path = url[len("kvf+unix://") :]
        if not path:
            raise ValueError(f"rendezvous address {url!r} has no socket path")
        return "unix", path
    if url.startswith("kvf://"):
        hostport = url[len("kvf://") :]
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"rendezvous address {url!r} must be kvf://HOST:PORT")
        return "tcp", hostport
    raise ValueError(f"rendezvous address {url!r}: expected kvf://HOST:PORT or kvf+unix:///PATH")
