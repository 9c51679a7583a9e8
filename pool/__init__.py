"""kvfabric.pool: the object pool with memory semantics (MemCache-like).

A meta service allocates space in the windows of the global virtual address space and
keeps the directory; clients write and read the memory directly, so object data never
passes through the service. Entry points:

* :func:`connect` — a client of a pool daemon (``kvfabric pool serve``) on this node;
* :class:`EmbeddedPool` — the whole pool in one process (no daemon);
* :class:`PoolClient` — put / get / exists / remove, batched and zero-copy.

Imports only ``kvfabric.platform`` below it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfabric.platform.base import Platform
    from kvfabric.pool.client.api import PoolClient


def connect(
    socket: str | None = None,
    *,
    name: str = "default",
    tcp: str | None = None,
    token: str = "",
    platform: Platform | None = None,
    timeout: float = 1.0,
    rpc_spin_us: float | None = None,
    etcd: str | None = None,
    etcd_auth: Any = None,
    **client_kwargs: Any,
) -> PoolClient:
    """A client of the pool daemon at ``socket`` (default: the named pool's socket) or
    ``tcp`` (``"host:port"``), or of the elected leader of pool ``name`` whose leadership
    lives in ``etcd`` (``"etcd://HOST:PORT"``; ``etcd_auth``: its TLS / auth settings,
    ``rendezvous.etcd.EtcdAuth``): the client finds the leader there and follows it across
    a change (``kvfabric.pool.client.leader``). Raises ``ServiceUnavailable`` if nothing
    answers within ``timeout``. ``rpc_spin_us``: how long a call polls for its reply before
    sleeping (default 100 µs on a Unix socket, 0 over TCP; see ``kvfabric.pool.client.rpc``).
    ``client_kwargs``: ``window_bytes``, ``window_medium``, ``metadata_only``."""
    from kvfabric.platform.registry import default
    from kvfabric.pool import protocol as p
    from kvfabric.pool.client.api import PoolClient
    from kvfabric.pool.client.rpc import SocketTransport
    from kvfabric.pool.config import default_socket

    transport: Any
    if etcd:
        from kvfabric.pool.client.leader import LeaderTransport

        transport = LeaderTransport(etcd, name, token=token, auth=etcd_auth, timeout=timeout)
        client_kwargs["etcd_auth"] = etcd_auth
    else:
        endpoint = f"tcp://{tcp}" if tcp else (socket or default_socket(name))
        transport = SocketTransport(endpoint, timeout=timeout, token=token, spin_us=rpc_spin_us)
    try:
        info = transport.call(p.Info()).data
        plat = platform or default()
        if plat.name != info["platform"]:
            raise ValueError(
                f"the pool runs on platform {info['platform']!r}; this process uses {plat.name!r}"
            )
        return PoolClient(transport, plat, **client_kwargs)
    except BaseException:
        transport.close()
        raise


def __getattr__(name: str) -> Any:
    if name == "PoolClient":
        from kvfabric.pool.client.api import PoolClient

        return PoolClient
    if name == "EmbeddedPool":
        from kvfabric.pool.service.node import EmbeddedPool

        return EmbeddedPool
    if name == "PoolConfig":
        from kvfabric.pool.config import PoolConfig

        return PoolConfig
    if name == "Status":
        from kvfabric.pool.status import Status

        return Status
    raise AttributeError(name)


__all__ = ["EmbeddedPool", "PoolClient", "PoolConfig", "Status", "connect"]
