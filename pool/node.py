"""Deprecated: moved to ``kvfabric.pool.service.node`` (the pool's service side)."""

import warnings

from kvfabric.pool.service.node import EmbeddedPool, PoolNode, StartStage

warnings.warn(
    "kvfabric.pool.node is deprecated; import from kvfabric.pool.service.node",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["EmbeddedPool", "PoolNode", "StartStage"]
