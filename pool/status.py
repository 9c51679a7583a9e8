"""Per-key outcomes of pool operations (the values travel in RPC status arrays)."""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    OK = 0
    EXISTS = 1  # put of a key that is already stored (or being stored): left untouched
    NOT_FOUND = 2  # no readable object under this key
    NO_SPACE = 3  # nothing fits even after eviction (or the directory is full)
    LEASE_EXPIRED = 4  # a write or read lease ran out before the operation finished
    INVALID = 5  # bad key or size (the message names which)
    TRANSFER_FAILED = 6  # the bytes could not be moved
    UNAVAILABLE = 7  # the meta service did not answer
    CORRUPT = 8  # the bytes read do not match the writer's checksum: treated as a miss
