"""Adopting the directory a crashed meta service left behind (a restart).

A restarted daemon finds the previous service's directory tables (named shared-memory
segments that survive a crash). For each it:

* retires it, so readers still mapping it stop trusting it and fetch the new table;
* fences every extent the previous service had handed out but not published
  (``ALLOCATED``) or had fenced itself (``REMOVING``): their writers may still be
  copying (``pool/service/fence.py``);
* when this node's own window survived, re-enters that window's readable objects with
  their checksums (``MetaService.reregister``), the replica extents there too (under their
  object's key: the service merges them with the extents other owners re-register);

and then removes it. Call with the service's lock held (the dispatcher's), once, after
the node's own rank joined the fabric.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from kvfabric.platform import shm
from kvfabric.platform.types import Medium
from kvfabric.pool import table as tbl
from kvfabric.pool.service.meta import MetaService
from kvfabric.pool.service.replicas import client_key
from kvfabric.pool.status import Status

log = logging.getLogger("kvfabric.pool")


def adopt_old_tables(service: MetaService, prefix: str, mine: str, rebuild: bool, rank: int = 0) -> int:
    """Adopt every table named ``prefix``* but ``mine`` (see module docstring); the number
    of objects re-entered. ``rank``: the node's own rank (its window's objects are rebuilt)."""
    named = shm.NAMED + prefix
    rebuilt = 0
    for name in sorted(n for n in os.listdir(shm.shm_dir()) if n.startswith(named) and n != mine):
        try:
            old = tbl.attach_any(name)
        except Exception as e:  # noqa: BLE001 - a torn or foreign segment: just remove it
            log.warning("dropping unreadable old directory table %s: %s", name, e)
            shm.unlink_named(name[len(shm.NAMED) :])
            continue
        old.retire()
        _fence_from(service, old)
        if rebuild:
            rebuilt += _rebuild_from(service, old, rank)
        old.close()
        shm.unlink_named(name[len(shm.NAMED) :])
    if rebuilt:
        log.warning("pool %r restarted: %d object(s) of its own window rebuilt", service.config.name, rebuilt)
    return rebuilt


def _rebuild_from(service: MetaService, old: tbl.TableView, rank: int = 0) -> int:
    w = service.windows.get((rank, Medium.DRAM))
    if w is None:
        return 0
    s = old.slots
    live = np.flatnonzero(
        (s["hash"] != 0)
        & np.isin(s["state"], [int(tbl.SlotState.READABLE), int(tbl.SlotState.REPLICA)])
        & (s["gva"] >= w.lo)
        & (s["gva"] + s["size"] <= w.hi)
    )
    keys = [client_key(old.key_of(int(i))) for i in live]
    st = service.reregister(
        keys,
        s["gva"][live].tolist(),
        s["size"][live].tolist(),
        s["gen"][live].tolist(),
        s["csum"][live].tolist(),
    )
    return sum(1 for x in st if x == Status.OK)


def _fence_from(service: MetaService, old: tbl.TableView) -> None:
    s = old.slots
    busy = (s["hash"] != 0) & np.isin(s["state"], [int(tbl.SlotState.ALLOCATED), int(tbl.SlotState.REMOVING)])
    idx = np.flatnonzero(busy)
    if not idx.size:
        return
    n = service.fence.adopt(s["gva"][idx].tolist(), s["size"][idx].tolist(), service.clock())
    log.warning(
        "pool %r restarted: %d extent(s) the previous service had handed out stay fenced for %.0f s "
        "(%d in windows not rejoined yet)",
        service.config.name,
        idx.size,
        service.config.fence_grace_s,
        idx.size - n,
    )
