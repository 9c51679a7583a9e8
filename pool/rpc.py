"""Deprecated: ``SocketTransport`` moved to ``kvfabric.pool.client.rpc``, ``LocalTransport``
(the embedded pool's, which needs the meta service) to ``kvfabric.pool.service.local``."""

import warnings

from kvfabric.pool.client.rpc import SocketTransport, Transport
from kvfabric.pool.service.local import LocalTransport

warnings.warn(
    "kvfabric.pool.rpc is deprecated; import SocketTransport from kvfabric.pool.client.rpc "
    "and LocalTransport from kvfabric.pool.service.local",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["LocalTransport", "SocketTransport", "Transport"]
