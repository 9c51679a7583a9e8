"""Argument checks shared by pool clients and the meta service.

Keys are non-empty strings of at most 256 UTF-8 bytes. Clients check what callers give
them (``encode_key(s)``, ``as_u64``, ``check_sizes``) before any RPC or copy; the service
checks every request again with the same functions (``check_keys``, ``check_sizes``,
``check_ids``, ``check_lengths``), so a client that skips the Python checks is refused the
same way. Every error is a ``ValueError`` (``TypeError`` for a wrong kind of argument in
the client API) naming the argument and, for lists, the first bad index:
``sizes[3] = -1: must be > 0``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

MAX_KEY_BYTES = 256
MAX_BATCH = 1 << 20  # items in one request: more is a broken or hostile client
U64_MAX = (1 << 64) - 1
MAX_TTL_S = float((1 << 30) // 10)  # the directory's expiry ticks (1/10 s, u32) wrap at twice this


def _key_problem(raw: bytes) -> str:
    """Why ``raw`` is not a valid key ('' when it is)."""
    if not raw:
        return "pool keys must not be empty"
    if len(raw) > MAX_KEY_BYTES:
        return f"pool key of {len(raw)} bytes is longer than {MAX_KEY_BYTES}: {raw[:40]!r}..."
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return f"pool key {raw[:40]!r} is not valid UTF-8"
    return ""


def encode_key(key: object) -> bytes:
    """The key's UTF-8 bytes; ``TypeError``/``ValueError`` naming the key when invalid."""
    if isinstance(key, str):
        raw = key.encode("utf-8")
    elif isinstance(key, bytes):
        raw = key
    else:
        raise TypeError(f"pool keys are str, got {type(key).__name__}")
    problem = _key_problem(raw)
    if problem:
        raise ValueError(problem)
    return raw


def encode_keys(keys: object) -> list[bytes]:
    if isinstance(keys, (str, bytes)):
        raise TypeError("batch operations take a list of keys, not a single key")
    return [encode_key(k) for k in keys]  # type: ignore[attr-defined]


def check_count(values: Sequence[Any], name: str) -> None:
    """A request list of at most ``MAX_BATCH`` items."""
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {type(values).__name__}")
    if len(values) > MAX_BATCH:
        raise ValueError(f"{name} holds {len(values)} items; one request takes at most {MAX_BATCH}")


def check_keys(keys: Sequence[Any], name: str = "keys") -> None:
    """Service side: every key is bytes, non-empty, at most 256 B and valid UTF-8."""
    check_count(keys, name)
    try:
        joined = b"".join(keys)  # fast path: all bytes, all ASCII, lengths in range
        if joined.isascii() and (
            not keys or (min(map(len, keys)) > 0 and max(map(len, keys)) <= MAX_KEY_BYTES)
        ):
            return
    except TypeError:
        pass
    for i, k in enumerate(keys):
        if not isinstance(k, bytes):
            raise ValueError(f"{name}[{i}]: pool keys are bytes on the wire, got {type(k).__name__}")
        problem = _key_problem(k)
        if problem:
            raise ValueError(f"{name}[{i}]: {problem}")


def check_lengths(name: str, first: Sequence[Any], **others: Sequence[Any]) -> None:
    """Parallel lists of one request hold as many items as ``first``."""
    check_count(first, name)
    for other, values in others.items():
        check_count(values, other)
        if len(values) != len(first):
            raise ValueError(f"{len(first)} {name} but {len(values)} {other}: the lists must match")


def _bad_int(v: Any, lo: int, hi: int) -> str:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        return "must be an integer"
    if v < lo:
        return f"must be > {lo - 1}" if lo == 1 else f"must be >= {lo}"
    if v > hi:
        return f"must be <= {hi}"
    return ""


def check_ints(values: Sequence[Any], name: str, lo: int = 0, hi: int = U64_MAX) -> list[int]:
    """Every item an integer in ``[lo, hi]`` (not a bool, not a float); as Python ints."""
    check_count(values, name)
    if not values or (set(map(type, values)) == {int} and min(values) >= lo and max(values) <= hi):
        return list(values)
    for i, v in enumerate(values):
        why = _bad_int(v, lo, hi)
        if why:
            raise ValueError(f"{name}[{i}] = {v!r}: {why}")
    return [int(v) for v in values]


def check_sizes(values: Sequence[Any], name: str = "sizes", hi: int = U64_MAX) -> list[int]:
    """Object or piece sizes: integers in ``[1, hi]``."""
    return check_ints(values, name, 1, hi)


def check_int(value: Any, name: str, lo: int = 0, hi: int = U64_MAX) -> int:
    """One integer argument in ``[lo, hi]``."""
    why = _bad_int(value, lo, hi)
    if why:
        raise ValueError(f"{name} = {value!r}: {why}")
    return int(value)


def as_u64(values: Any, name: str, positive: bool = False) -> np.ndarray:
    """Client side: addresses or sizes as a flat contiguous uint64 array, refusing what
    numpy would wrap or truncate (negatives, fractions, bools, values past 2**64 - 1) with a
    ``ValueError`` naming ``name`` and the first bad index. ``positive``: 0 is refused too."""
    a = np.asarray(values)
    if a.dtype.kind == "f" and not isinstance(values, np.ndarray):
        a = np.asarray(values, dtype=object)  # Python ints past 2**63 turn numpy to float
    lo = 1 if positive else 0
    if a.dtype.kind == "u" and a.dtype.itemsize <= 8:
        out = a.astype(np.uint64, copy=False).reshape(-1)
        if positive and out.size and not out.all():
            i = int(np.flatnonzero(out == 0)[0])
            raise ValueError(f"{name}[{i}] = 0: must be > 0")
        return np.ascontiguousarray(out)
    if a.dtype.kind == "i":
        flat = a.reshape(-1)
        if flat.size and int(flat.min()) < lo:
            i = int(np.flatnonzero(flat < lo)[0])
            raise ValueError(f"{name}[{i}] = {int(flat[i])}: {_bad_int(int(flat[i]), lo, U64_MAX)}")
        return np.ascontiguousarray(flat.astype(np.uint64))
    flat = a.reshape(-1).tolist() if a.dtype.kind in "bfcOUS" else None
    if flat is None:
        raise ValueError(f"{name}: expected integers, got an array of {a.dtype}")
    for i, v in enumerate(flat):
        why = _bad_int(v, lo, U64_MAX)
        if why:
            raise ValueError(f"{name}[{i}] = {v!r}: {why}")
    return np.ascontiguousarray(np.array(flat, dtype=np.uint64))
