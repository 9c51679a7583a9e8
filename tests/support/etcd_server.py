"""The test etcd lives in :mod:`kvfabric.harness.etcd` (the cluster benchmark starts one
too); tests import it from here."""

from kvfabric.harness.etcd import etcd_binary, etcd_server, tls_files

__all__ = ["etcd_binary", "etcd_server", "tls_files"]
