"""Deprecated: moved to ``kvfabric.pool.service.daemon`` (the pool's service side)."""

import warnings

from kvfabric.pool.service.daemon import PoolDaemon

warnings.warn(
    "kvfabric.pool.daemon is deprecated; import from kvfabric.pool.service.daemon",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["PoolDaemon"]
