"""Block ids: 16-byte, chained, configuration-seeded names of KV blocks.

Contract (specified byte for byte in ``docs/hashing.md``, whose worked example a test
checks):

* A :class:`Fingerprint` (model, KV dtype, KV layout, block size, TP size, salt) digests to
  16 bytes that key every block hash, so two configurations never share an id.
* ``id[i] = H(fingerprint, base(id[i-1]), content of block i)`` where the content is the
  block's token ids (plus optional per-block extra keys: LoRA name, multimodal hashes,
  cache salt) or an engine's own chained block hash (vLLM's ``request.block_hashes``).
  ``H`` is keyed BLAKE2b; the first 13 bytes are the hash, bytes 13..15 are reserved tail
  bytes: byte 13 the KV-cache group, bytes 14..15 the rank (big endian). Hashing writes
  zeros there (a *base* id); :func:`tag` stamps rank and group afterwards, so one prefix
  maps to per-rank keys without re-hashing, and the chain always runs over base ids.
* Only full blocks get ids. Ids travel as an ``(n, 16)`` uint8 array.
* Deterministic across processes and machines whatever ``PYTHONHASHSEED`` is (nothing
  here uses Python's ``hash``).
* Any hashing error (a token that is not an unsigned 32-bit int, an extra key of a type
  the encoding does not know, an engine hash that is neither bytes nor int) is a miss,
  never a crash: the call returns the ids of the blocks before the failing one and logs
  a warning once per kind of error. Bad *configuration* (a fingerprint field of the
  wrong type, a rank out of range) raises ``ValueError`` / ``TypeError``.

Thread-safe: a :class:`BlockHasher` is immutable.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import logging
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvfabric.ucm_layer.store.base import ID_BYTES

log = logging.getLogger("kvfabric.hashing")

HASH_BYTES = 13  #: bytes 0..12 of an id are the hash
GROUP_BYTE = 13  #: byte 13: KV-cache group (0..255)
RANK_BYTES = slice(14, 16)  #: bytes 14..15: rank, big endian (0..65535)
MAX_RANK = 0xFFFF
MAX_GROUP = 0xFF

PERSON_FINGERPRINT = b"kvf-fprint-v1"
PERSON_TOKENS = b"kvf-tokens-v1"
PERSON_ENGINE = b"kvf-engine-v1"
_ZERO_TAIL = bytes(ID_BYTES - HASH_BYTES)
_ROOT = bytes(ID_BYTES)  # the parent of the first block

_warned: set[str] = set()


def _warn_once(kind: str, msg: str, *args: object) -> None:
    if kind not in _warned:
        _warned.add(kind)
        log.warning(msg + " (treated as a miss; further errors of this kind are not logged)", *args)


# ---------------------------------------------------------------------------- encoding
def encode_key(obj: Any) -> bytes:
    """The canonical bytes of an extra key (see docs/hashing.md, "Canonical encoding").

    None, bool, int, float, str, bytes-like, and tuples/lists of those. Anything else is
    a ``TypeError``.
    """
    out = bytearray()
    _encode(obj, out)
    return bytes(out)


def _encode(obj: Any, out: bytearray) -> None:
    if obj is None:
        out += b"N"
    elif obj is True or obj is False:
        out += b"T" if obj else b"F"
    elif isinstance(obj, (int, np.integer)):
        v = int(obj)
        raw = v.to_bytes(v.bit_length() // 8 + 1, "big", signed=True)
        out += b"I" + struct.pack(">I", len(raw)) + raw
    elif isinstance(obj, (float, np.floating)):
        out += b"D" + struct.pack(">d", float(obj))
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        out += b"S" + struct.pack(">I", len(raw)) + raw
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        raw = bytes(obj)
        out += b"B" + struct.pack(">I", len(raw)) + raw
    elif isinstance(obj, (tuple, list)):
        out += b"L" + struct.pack(">I", len(obj))
        for item in obj:
            _encode(item, out)
    else:
        raise TypeError(f"cannot encode a {type(obj).__name__} in a block id")


# ---------------------------------------------------------------------------- fingerprint
@dataclass(frozen=True)
class Fingerprint:
    """What makes KV bytes of the same tokens differ: ids of different fingerprints never meet.

    ``kv_layout`` names what a block's bytes mean as the store sees them (e.g.
    ``"2x28x64KiB"``, ``"mla-61x2"``; the vLLM connector's form, with the physical layout's
    signature, is in docs/hashing.md); ``salt`` isolates tenants or deployments.
    """

    model: str
    kv_dtype: str
    kv_layout: str
    block_size: int
    tp_size: int = 1
    salt: str = ""

    def __post_init__(self) -> None:
        for name in ("model", "kv_dtype", "kv_layout", "salt"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Fingerprint.{name} must be a str, got {type(getattr(self, name)).__name__}")
        for name in ("block_size", "tp_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Fingerprint.{name} must be an int >= 1, got {v!r}")

    def fields(self) -> tuple[Any, ...]:
        return (
            "kvfabric-fingerprint",
            1,
            self.model,
            self.kv_dtype,
            self.kv_layout,
            self.block_size,
            self.tp_size,
            self.salt,
        )

    def digest(self) -> bytes:
        """16 bytes: BLAKE2b-128 of the canonical encoding of :meth:`fields`."""
        return hashlib.blake2b(encode_key(self.fields()), digest_size=16, person=PERSON_FINGERPRINT).digest()

    def to_mapping(self) -> dict[str, Any]:
        """The fields by name (what the connector logs at start-up, what ``kvfabric doctor``
        compares)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_mapping(cls, data: Any) -> Fingerprint:
        """A fingerprint from :meth:`to_mapping`'s form; ``ValueError`` naming a missing or
        unknown field."""
        if not isinstance(data, dict):
            raise ValueError(f"a fingerprint is a mapping of its fields, got {type(data).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown fingerprint field(s) {unknown}; known: {known}")
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(f"fingerprint: {e}") from None


# ---------------------------------------------------------------------------- tags
def tag(ids: np.ndarray, rank: int = 0, group: int = 0) -> np.ndarray:
    """A copy of ``ids`` with ``rank`` and ``group`` stamped in the reserved tail bytes."""
    for name, v, hi in (("rank", rank, MAX_RANK), ("group", group, MAX_GROUP)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= hi:
            raise ValueError(f"{name} must be an int in [0, {hi}], got {v!r}")
    out = np.array(ids, dtype=np.uint8, copy=True, ndmin=2)
    if out.shape[1] != ID_BYTES:
        raise ValueError(f"ids must be (n, {ID_BYTES}) uint8, got shape {out.shape}")
    out[:, GROUP_BYTE] = group
    out[:, RANK_BYTES] = (rank >> 8, rank & 0xFF)
    return out


def untag(ids: np.ndarray) -> np.ndarray:
    """The base ids (tail bytes zeroed)."""
    return tag(ids, 0, 0)


def rank_of(ids: np.ndarray) -> np.ndarray:
    a = np.asarray(ids, dtype=np.uint8).reshape(-1, ID_BYTES)
    return (a[:, 14].astype(np.int64) << 8) | a[:, 15]


def group_of(ids: np.ndarray) -> np.ndarray:
    return np.asarray(ids, dtype=np.uint8).reshape(-1, ID_BYTES)[:, GROUP_BYTE].astype(np.int64)


def to_hex(ids: np.ndarray) -> list[str]:
    """Lower-case hex names of ids (how the posix store names files)."""
    h = np.ascontiguousarray(ids, dtype=np.uint8).tobytes().hex()
    w = 2 * ID_BYTES
    return [h[i : i + w] for i in range(0, len(h), w)]


def from_hex(names: Sequence[str]) -> np.ndarray:
    return np.frombuffer(bytes.fromhex("".join(names)), np.uint8).reshape(-1, ID_BYTES).copy()


# ---------------------------------------------------------------------------- hasher
def _token_bytes(tokens: Any) -> bytes:
    """Little-endian uint32 bytes of ``tokens``; ``ValueError``/``TypeError`` when one
    is not an unsigned 32-bit integer."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise TypeError(f"tokens must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFFFFFF):
            raise ValueError("a token id is outside [0, 2**32)")
        return tokens.astype("<u4", copy=False).tobytes()
    arr = array.array("I", tokens)  # C-speed conversion with range checks
    if arr.itemsize != 4:
        raise TypeError("this platform's C unsigned int is not 32 bits")
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def _parent_bytes(parent: Any) -> bytes:
    if parent is None:
        return _ROOT
    raw = bytes(np.asarray(parent, dtype=np.uint8).reshape(-1))
    if len(raw) != ID_BYTES:
        raise ValueError(f"parent must be one {ID_BYTES}-byte id, got {len(raw)} bytes")
    return raw[:HASH_BYTES] + _ZERO_TAIL


def _as_ids(chunks: list[bytes]) -> np.ndarray:
    if not chunks:
        return np.zeros((0, ID_BYTES), np.uint8)
    return np.frombuffer(b"".join(chunks), np.uint8).reshape(-1, ID_BYTES).copy()


class BlockHasher:
    """Computes base block ids for one :class:`Fingerprint` (see module docstring)."""

    def __init__(self, fingerprint: Fingerprint) -> None:
        if not isinstance(fingerprint, Fingerprint):
            raise TypeError(f"BlockHasher needs a Fingerprint, got {type(fingerprint).__name__}")
        self.fingerprint = fingerprint
        self.block_size = fingerprint.block_size
        key = fingerprint.digest()
        self._tokens = hashlib.blake2b(digest_size=16, key=key, person=PERSON_TOKENS)
        self._engine = hashlib.blake2b(digest_size=16, key=key, person=PERSON_ENGINE)

    def hash_tokens(
        self,
        tokens: Sequence[int] | np.ndarray,
        extra_keys: Sequence[Any] | None = None,
        parent: Any = None,
    ) -> np.ndarray:
        """Ids of the full blocks of ``tokens``, chained from ``parent`` (the id of the block
        before ``tokens[0]``; None at the start of a sequence). ``extra_keys[i]``, when given,
        belongs to block ``i`` (None or an empty tuple: no extra keys)."""
        out: list[bytes] = []
        try:
            prev = _parent_bytes(parent)
            try:
                data = _token_bytes(tokens)
            except (TypeError, ValueError, OverflowError):
                data = self._good_prefix_bytes(tokens)
            step = 4 * self.block_size
            n = len(data) // step
            if extra_keys is not None and len(extra_keys) < n:
                _warn_once("extra-len", "block hashing: %d extra_keys for %d blocks", len(extra_keys), n)
                n = len(extra_keys)
            view = memoryview(data)
            base = self._tokens
            for i in range(n):
                h = base.copy()
                h.update(prev)
                h.update(view[i * step : (i + 1) * step])
                if extra_keys is not None:
                    ek = extra_keys[i]
                    if ek is not None and not (isinstance(ek, (tuple, list)) and not ek):
                        h.update(encode_key(ek))
                prev = h.digest()[:HASH_BYTES] + _ZERO_TAIL
                out.append(prev)
        except Exception as e:  # noqa: BLE001 - a hashing error is a miss
            _warn_once(f"tokens-{type(e).__name__}", "block hashing from tokens failed: %s", e)
        return _as_ids(out)

    def _good_prefix_bytes(self, tokens: Any) -> bytes:
        """Token bytes of the full blocks before the first bad token (slow path, errors only)."""
        _warn_once("token-value", "block hashing: a token id is not an unsigned 32-bit int")
        bs = self.block_size
        good = []
        seq = list(tokens)
        for i in range(len(seq) // bs):
            try:
                good.append(_token_bytes(seq[i * bs : (i + 1) * bs]))
            except (TypeError, ValueError, OverflowError):
                break
        return b"".join(good)

    def hash_engine(self, block_hashes: Sequence[bytes | int], parent: Any = None) -> np.ndarray:
        """Ids from an engine's own chained block hashes (e.g. vLLM's ``request.block_hashes``,
        bytes, or ints in older releases), one id per hash, chained from ``parent``."""
        out: list[bytes] = []
        try:
            prev = _parent_bytes(parent)
            base = self._engine
            for bh in block_hashes:
                if isinstance(bh, (bytes, bytearray, memoryview)):  # == encode_key(bytes(bh))
                    raw = b"B" + struct.pack(">I", len(bh)) + bytes(bh)
                elif isinstance(bh, (int, np.integer)) and not isinstance(bh, bool):
                    raw = encode_key(int(bh))
                else:
                    raise TypeError(f"an engine block hash must be bytes or int, got {type(bh).__name__}")
                h = base.copy()
                h.update(prev)
                h.update(raw)
                prev = h.digest()[:HASH_BYTES] + _ZERO_TAIL
                out.append(prev)
        except Exception as e:  # noqa: BLE001 - a hashing error is a miss
            _warn_once(f"engine-{type(e).__name__}", "block hashing from engine hashes failed: %s", e)
        return _as_ids(out)

    def __repr__(self) -> str:
        return f"BlockHasher({self.fingerprint!r})"
