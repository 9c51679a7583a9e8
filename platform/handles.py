"""Encoding of IPC handles: what ``export_handle`` returns and ``import_handle`` takes.

A handle is a self-describing msgpack record (platform, medium, size, owner pid and the
backend's own payload: a shared-memory name, a ``cudaIpcMemHandle_t``, an ACL export
key), so a handle given to the wrong platform, truncated or corrupted is refused with a
clear ``HandleError`` instead of mapping the wrong memory.
"""

from __future__ import annotations

import msgspec

from kvfabric.errors import HandleError
from kvfabric.platform.types import Medium

_MAGIC = "kvfabric-ipc-1"


class HandleRecord(msgspec.Struct, frozen=True):
    magic: str
    platform: str
    medium: str
    nbytes: int
    owner_pid: int
    device: int
    payload: bytes


def encode(platform: str, medium: Medium, nbytes: int, owner_pid: int, device: int, payload: bytes) -> bytes:
    rec = HandleRecord(_MAGIC, platform, medium.value, nbytes, owner_pid, device, payload)
    return msgspec.msgpack.encode(rec)


def decode(handle: bytes, expect_platform: str) -> HandleRecord:
    if not isinstance(handle, (bytes, bytearray, memoryview)):
        raise TypeError(f"an IPC handle is bytes, got {type(handle).__name__}")
    try:
        rec = msgspec.msgpack.decode(bytes(handle), type=HandleRecord)
    except msgspec.DecodeError as e:
        raise HandleError(f"not a kvfabric IPC handle ({len(handle)} bytes): {e}") from e
    if rec.magic != _MAGIC:
        raise HandleError(f"IPC handle has version {rec.magic!r}, this build reads {_MAGIC!r}")
    if rec.platform != expect_platform:
        raise HandleError(
            f"IPC handle was exported by platform {rec.platform!r}; it cannot be imported on "
            f"{expect_platform!r}"
        )
    if rec.nbytes <= 0:
        raise HandleError(f"IPC handle names a size of {rec.nbytes} B")
    try:
        Medium(rec.medium)
    except ValueError:
        raise HandleError(f"IPC handle names unknown medium {rec.medium!r}") from None
    return rec
