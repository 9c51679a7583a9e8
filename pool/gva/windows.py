"""This rank's windows and its mappings of the others': what ``Fabric`` keeps in step.

``prepare`` turns the ``windows`` argument of a join into platform buffers and the
window records published in the member record (an exported IPC handle when the buffer
can be shared). ``map_table`` builds the endpoints of a new :class:`View`: this rank's
own windows, same-node windows mapped through ``Platform.import_handle`` (reusing
mappings that already exist), and unmapped endpoints for the rest; mappings whose
incarnation left the table are returned for retirement.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from kvfabric.errors import KVFabricError
from kvfabric.platform.base import Platform
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.types import BufferKind, Medium
from kvfabric.pool.gva.address import MEDIUM_REGION, window_key
from kvfabric.pool.gva.segments import SegmentTable, WindowRecord
from kvfabric.pool.gva.view import Endpoint, MappedWindow

log = logging.getLogger("kvfabric.gva")

MapKey = tuple[str, Medium]  # (member token, medium)


def prepare(
    plat: Platform, windows: Mapping[Medium | str, int | Buffer], owned: list[Buffer]
) -> tuple[dict[Medium, Buffer], list[WindowRecord]]:
    """Buffers and records of the windows to contribute; buffers allocated here are
    appended to ``owned`` as they are made (the caller frees them on failure)."""
    bufs: dict[Medium, Buffer] = {}
    records = []
    for med_key, spec in windows.items():
        med = Medium.parse(med_key)
        if med in bufs:
            raise ValueError(f"two windows of medium {med.value}: a rank contributes at most one per medium")
        if isinstance(spec, Buffer):
            if spec.platform is not plat:
                raise ValueError(f"window {spec!r} belongs to another platform instance")
            if spec.medium is not med:
                raise ValueError(f"window {spec!r} is {spec.medium.value}, given as {med.value}")
            buf = spec
        else:
            if isinstance(spec, bool) or not isinstance(spec, int) or spec <= 0:
                raise ValueError(f"window size for {med.value} must be an int > 0, got {spec!r}")
            buf = plat.alloc(spec, med, shareable=True)
            owned.append(buf)
        exportable = buf.kind is BufferKind.OWNED and buf.shareable
        handle = plat.export_handle(buf) if exportable else b""
        bufs[med] = buf
        records.append(WindowRecord(med.value, buf.nbytes, handle, buf.ptr))
    return bufs, records


def map_table(
    table: SegmentTable,
    plat: Platform,
    *,
    token: str,
    node: str,
    rank: int,
    own: Mapping[Medium, Buffer],
    maps: dict[MapKey, MappedWindow],
    can_map: bool,
) -> tuple[dict[int, Endpoint], list[MappedWindow]]:
    """Endpoints for ``table`` and the mappings to retire (``maps`` is updated in place)."""
    ends: dict[int, Endpoint] = {}
    live: set[MapKey] = set()
    for seg in table.segments:
        key = window_key(MEDIUM_REGION[seg.medium], seg.rank)
        if seg.member.token == token:
            buf = own[seg.medium]
            ends[key] = Endpoint(seg, buf.ptr, buf, None)
            continue
        mkey = (seg.member.token, seg.medium)
        m = maps.get(mkey)
        same_node = seg.node == node and seg.member.platform == plat.name and bool(seg.window.handle)
        if m is None and can_map and same_node:
            try:
                m = MappedWindow(seg, plat.import_handle(seg.window.handle))
                maps[mkey] = m
            except (KVFabricError, ValueError, OSError) as e:
                log.warning(
                    "rank %d: cannot map rank %d's %s window: %s", rank, seg.rank, seg.medium.value, e
                )
        if m is not None:
            live.add(mkey)
            ends[key] = Endpoint(seg, m.buffer.ptr, m.buffer, m)
        else:
            ends[key] = Endpoint(seg, 0, None, None)
    now = time.monotonic()
    retired = []
    for mkey in [k for k in maps if k not in live]:
        m = maps.pop(mkey)
        m.retired_at = now
        retired.append(m)
    return ends, retired
