"""kvfabric.pool.service: the pool's meta service side (what a pool daemon or an embedded
pool runs), never imported by a client.

* ``meta.py`` — :class:`MetaService`: directory, space, leases, eviction and expiry;
  ``records.py`` its records; ``allocator.py`` the extents of one window; ``fence.py`` the
  write fence; ``table_writer.py`` the only writer of the shared directory table;
  ``adopt.py`` re-adopting the tables of a previous daemon;
* ``dispatch.py`` — :class:`Dispatcher`: validates requests and calls the meta service;
  ``local.py`` the in-process transport of an embedded pool; ``server.py`` the RPC server;
* ``node.py`` — :class:`PoolNode` / :class:`EmbeddedPool`: a meta service, its rendezvous
  store and fabric, started in stages; ``daemon.py`` the ``kvfabric pool serve`` process
  (``lock.py`` its pid lock, ``http.py`` its HTTP endpoint, ``metrics.py`` Prometheus).

Imports ``kvfabric.pool.client`` (an embedded pool hands out clients), the shared
vocabulary at ``kvfabric.pool`` top level, ``kvfabric.pool.gva`` and ``kvfabric.platform``.
"""
