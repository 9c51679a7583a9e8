"""``GvaConfig``: the configuration of one process's view of a GVA pool.

Transports are chosen per (source rank, destination rank) pair: the first
:class:`PairRule` that matches the pair gives the allowed transports in order (the
allow-list); with no matching rule, ``transports`` applies. Among the allowed ones, the
first that can serve the pair from this process is used (``mapped`` needs both ends
addressable here; ``remote`` needs one end here and the other rank to publish a route).
A local buffer counts as this process's own rank for rule matching.

Every field is checked against its annotation first (``kvfabric.settings``), so a wrong
type names the field and what was expected; :meth:`GvaConfig.from_mapping` also refuses
unknown keys with the sorted list of the known ones.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kvfabric.envs import MC_TCP_BIND_ADDRESS
from kvfabric.settings import coerce_fields, load, setting

KNOWN_TRANSPORTS = ("mapped", "remote")


@dataclass(frozen=True)
class PairRule:
    """Transports allowed from ``src`` to ``dst`` (ranks; ``None`` matches any rank)."""

    src: int | None = setting(doc="source rank (None: any)", lo=0)
    dst: int | None = setting(doc="destination rank (None: any)", lo=0)
    transports: tuple[str, ...] = setting(doc="allowed transports, in order", choices=KNOWN_TRANSPORTS)

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"PairRule.{key}")
        _check_transports(self.transports, "PairRule.transports")

    def matches(self, src: int, dst: int) -> bool:
        return (self.src is None or self.src == src) and (self.dst is None or self.dst == dst)


def _check_transports(names: tuple[str, ...], what: str) -> None:
    """Not empty (the names themselves are checked by the field's ``choices``)."""
    if not names:
        raise ValueError(f"{what} must name at least one transport of {', '.join(KNOWN_TRANSPORTS)}")


def default_node() -> str:
    """This machine's identity: host name and kernel boot id (same node = same kernel)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        boot = "noboot"
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class GvaConfig:
    """How this process joins a pool and moves bytes.

    ``namespace``: key prefix of the pool in the rendezvous store (several pools may share
    one store). ``node``: ranks with equal node ids map each other's windows (default:
    host name + boot id). ``alignment``: every GVA offset, local address and size of a
    copy must be a multiple of it (1: no constraint). ``dram_stride`` / ``hbm_stride``:
    pin the strides (0: derived from the largest window; pinning keeps addresses stable
    when a larger window joins later). ``remote_host``: the address the remote engine
    advertises (``MC_TCP_BIND_ADDRESS`` when set, else 127.0.0.1). ``heartbeat_ttl``:
    seconds after which a silent rank is removed (etcd lease TTL). ``unmap_grace``:
    seconds a departed rank's window stays mapped here (spans from ``resolve`` stay
    readable that long). ``remote_read_timeout``: a synchronous read from another node's
    window fails (``TransferFailed``: a miss to the pool) when the engine has not finished
    it by then; the engine reads into a staging buffer and the bytes reach the caller only
    once it did, so a read given up never lands in the caller's memory (0: no bound, read
    straight into it). ``remote_suspect_time``: after such a timeout (or a failed
    synchronous copy), copies to that rank fail at once for this long, unless a read given
    up completes first or the rank leaves. ``extra``: backend-specific keys (e.g. ``mooncake_protocol``).
    """

    namespace: str = setting("kvfabric/gva/default", doc="key prefix of the pool in the rendezvous store")
    node: str = setting(
        default_factory=default_node, doc="ranks with equal node ids map each other's windows"
    )
    transports: tuple[str, ...] = setting(
        ("mapped",), doc="transports of pairs no rule matches, in order", choices=KNOWN_TRANSPORTS
    )
    pair_rules: tuple[PairRule, ...] = setting((), doc="per (source, destination) transport allow-lists")
    alignment: int = setting(1, doc="offsets, addresses and sizes of copies: multiples of it", lo=1)
    dram_stride: int = setting(0, doc="pinned DRAM stride (0: from the largest window)", lo=0)
    hbm_stride: int = setting(0, doc="pinned HBM stride (0: from the largest window)", lo=0)
    remote_engine: str = setting("mooncake", doc="the remote transport's engine")
    remote_host: str = setting(
        default_factory=lambda: MC_TCP_BIND_ADDRESS.get() or "127.0.0.1",
        doc="the address the remote engine advertises",
    )
    copy_streams: int = setting(1, doc="streams a process copies on", lo=1)
    join_timeout: float = setting(30.0, doc="seconds to wait for the rendezvous when joining", gt=0)
    # etcd cannot ask a starved process whether it lives: roomy
    heartbeat_ttl: float = setting(10.0, doc="seconds after which a silent rank is removed", gt=0)
    unmap_grace: float = setting(5.0, doc="seconds a departed rank's window stays mapped here", lo=0)
    remote_read_timeout: float = setting(
        1.0,
        doc="seconds a synchronous read from another node waits for the engine before it fails "
        "(0: no bound, the engine reads straight into the caller's memory)",
        lo=0,
        hi=3600,
    )
    remote_suspect_time: float = setting(
        5.0,
        doc="seconds copies to a rank fail at once after a read from it timed out or a copy failed",
        lo=0,
        hi=3600,
    )
    extra: Mapping[str, Any] = setting(default_factory=dict, doc="backend-specific keys")

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"GvaConfig.{key}")
        if not self.namespace.strip("/"):
            raise ValueError(f"GvaConfig.namespace must be a non-empty str, got {self.namespace!r}")
        object.__setattr__(self, "namespace", self.namespace.rstrip("/"))
        if not self.node:
            raise ValueError(f"GvaConfig.node must be a non-empty str, got {self.node!r}")
        _check_transports(self.transports, "GvaConfig.transports")
        if self.alignment & (self.alignment - 1):
            raise ValueError(f"GvaConfig.alignment must be a power of two >= 1, got {self.alignment!r}")
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> GvaConfig:
        """A config from a mapping (a parsed YAML or JSON document); unknown keys refused."""
        return load(cls, data, what="GvaConfig")

    def allowed(self, src: int, dst: int) -> tuple[str, ...]:
        """The transports allowed, in order, from rank ``src`` to rank ``dst``."""
        for r in self.pair_rules:
            if r.matches(src, dst):
                return r.transports
        return self.transports
