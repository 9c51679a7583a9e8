"""kvfabric.pool.client: a pool client, with no meta-service code in it.

* ``api.py`` — :class:`PoolClient`: put / get / exists / remove, batched and zero-copy;
* ``session.py`` — :class:`Session`: one client's link to its pool (metadata RPCs, the
  fabric rank, the mapped directory table, catching up with a restarted service);
* ``reads.py`` / ``writes.py`` — the read and write paths, each over a ``Session``;
* ``rpc.py`` — the socket transport to a daemon; ``dataplane.py`` — object bytes moved
  over the GVA fabric.

Imports the shared vocabulary at ``kvfabric.pool`` top level (protocol, status, keys,
config, table, windows), ``kvfabric.pool.gva`` and ``kvfabric.platform``; never
``kvfabric.pool.service`` (an embedded pool, which needs the service, comes from
``kvfabric.pool.EmbeddedPool``, imported lazily).
"""

from kvfabric.pool.client.api import PoolClient
from kvfabric.pool.client.session import ClientOptions, Session, gva_config
from kvfabric.pool.keys import KeyBatch

__all__ = ["ClientOptions", "KeyBatch", "PoolClient", "Session", "gva_config"]
