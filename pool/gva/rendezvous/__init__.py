"""Rendezvous: the small key-value contract membership is built on, and its stores.

``connect(url)`` picks the implementation by scheme (one registry, imported lazily):

* ``kvf://HOST:PORT`` / ``kvf+unix:///PATH``: the single-node store
  (``server.RendezvousServer``, hosted by the pool daemon or a test; ``client.RendezvousClient``).
* ``etcd://HOST:PORT``: etcd v3 through its JSON gateway (``etcd.EtcdStore``), for several nodes.

The contract is in ``base.py``; barrier and all-gather in ``collectives.py``.
"""

from __future__ import annotations

from typing import Any

from kvfabric.pool.gva.rendezvous.base import Compacted, KeyValue, KVStore, WatchEvent
from kvfabric.registry import Registry

STORES: Registry[type[KVStore]] = Registry(
    "rendezvous scheme",
    {
        "kvf": "kvfabric.pool.gva.rendezvous.client:RendezvousClient",
        "kvf+unix": "kvfabric.pool.gva.rendezvous.client:RendezvousClient",
        "etcd": "kvfabric.pool.gva.rendezvous.etcd:EtcdStore",
    },
    group="kvfabric.rendezvous",
)


def store_options(url: str, token: str = "", etcd_auth: Any = None) -> dict[str, Any]:
    """The options ``connect`` takes for ``url``'s kind of store: the ``token`` of a
    ``kvf://`` server (TCP; a Unix socket needs none), the ``auth`` (``etcd.EtcdAuth``) of
    etcd."""
    if url.startswith("kvf://"):
        return {"token": token} if token else {}
    if url.startswith("etcd://"):
        return {"auth": etcd_auth} if etcd_auth is not None else {}
    return {}


def connect(url: str, **options: Any) -> KVStore:
    """A new session with the store at ``url`` (see module docstring for schemes).
    ``options``: the store's keyword arguments (``store_options`` builds them)."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"rendezvous url {url!r} must look like kvf://HOST:PORT or etcd://HOST:PORT")
    scheme = url.split("://", 1)[0]
    if scheme not in STORES:
        raise ValueError(
            f"unknown rendezvous scheme {scheme!r} in {url!r}; known: {', '.join(STORES.names())}"
        )
    return STORES.create(scheme, url, **options)


__all__ = ["STORES", "Compacted", "KVStore", "KeyValue", "WatchEvent", "connect", "store_options"]
