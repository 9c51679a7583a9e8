"""Argument checks shared by pool clients and the meta service, and the pool's keys.

Keys are any bytes, 1 to ``MAX_KEY_BYTES`` (256) long, except those that start with
``RESERVED_PREFIX`` (the service's own slots: the write fence's tombstones): a ``str`` key
is its UTF-8 bytes (so a text key is always valid UTF-8 and never reserved), a ``bytes``
key is taken as it is (binary keys, such as the block ids of the pool store, need no text
form). A :class:`KeyBatch` carries
many keys of one width as an ``(n, width)`` uint8 matrix, checked once for the whole batch
(its shape, its dtype, its byte values) and handed to the RPC as bytes with no per-key
Python work; ``KeyBatch.of_ids`` builds one from a prefix, an ``(n, 16)`` id array and a
suffix. ``key_text`` / ``key_from_text`` render a key readably (text as it is, other
bytes as ``\\xNN``) and back, for listings and messages.

Clients check what callers give them (``encode_key(s)``, ``as_u64``, ``check_sizes``)
before any RPC or copy; the service checks every request again with the same functions
(``check_keys``, ``check_sizes``, ``check_ids``, ``check_lengths``), so a client that
skips the Python checks is refused the same way. Every error is a ``ValueError``
(``TypeError`` for a wrong kind of argument in the client API) naming the argument and,
for lists, the first bad index: ``sizes[3] = -1: must be > 0``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

MAX_KEY_BYTES = 256
MAX_BATCH = 1 << 20  # items in one request: more is a broken or hostile client
U64_MAX = (1 << 64) - 1
MAX_TTL_S = float((1 << 30) // 10)  # the directory's expiry ticks (1/10 s, u32) wrap at twice this
#: keys starting with these bytes are the service's own (no UTF-8 text starts with them)
RESERVED_PREFIX = b"\xff\xfe"  # two bytes (KeyBatch checks its two columns)


def _key_problem(raw: bytes) -> str:
    """Why ``raw`` is not a valid key ('' when it is)."""
    if not raw:
        return "pool keys must not be empty"
    if len(raw) > MAX_KEY_BYTES:
        return f"pool key of {len(raw)} bytes is longer than {MAX_KEY_BYTES}: '{key_text(raw[:40])}...'"
    if raw.startswith(RESERVED_PREFIX):
        return f"pool key '{key_text(raw[:40])}' starts with {key_text(RESERVED_PREFIX)}, which is reserved"
    return ""


def key_text(raw: bytes) -> str:
    """``raw`` readably: printable text as it is, ``\\`` as ``\\\\``, every other byte
    as ``\\xNN`` (so binary keys list legibly and ``key_from_text`` gives the bytes back)."""
    try:
        text = raw.decode("utf-8")
        if text.isprintable() and "\\" not in text:
            return text
    except UnicodeDecodeError:
        pass
    out = []
    for ch in raw.decode("utf-8", "surrogateescape"):
        if ch == "\\":
            out.append("\\\\")
        elif "\udc80" <= ch <= "\udcff":  # a byte that is not UTF-8
            out.append(f"\\x{ord(ch) - 0xDC00:02x}")
        elif ch.isprintable():
            out.append(ch)
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode("utf-8"))
    return "".join(out)


def key_from_text(text: str) -> bytes:
    """The bytes ``key_text`` rendered as ``text`` (``ValueError`` for a bad escape)."""
    out = bytearray()
    i = 0
    while i < len(text):
        j = text.find("\\", i)
        if j < 0:
            out += text[i:].encode("utf-8")
            break
        out += text[i:j].encode("utf-8")
        if text.startswith("\\\\", j):
            out += b"\\"
            i = j + 2
            continue
        digits = text[j + 2 : j + 4] if text.startswith("\\x", j) else ""
        if len(digits) != 2 or not all(c in "0123456789abcdefABCDEF" for c in digits):
            raise ValueError(f"bad escape at {j} in key text {text!r}: use \\\\ or \\xNN")
        out.append(int(digits, 16))
        i = j + 4
    return bytes(out)


class KeyBatch:
    """``n`` pool keys of one width, as an ``(n, width)`` uint8 matrix (see module docstring).

    Checked whole when built (``ValueError`` naming the first bad index); immutable after
    (the matrix is a read-only array the batch owns). ``tolist()`` gives the keys as bytes
    (made once, in C), ``len`` their count, ``batch[i]`` one of them."""

    __slots__ = ("_keys", "matrix")

    def __init__(self, matrix: Any, name: str = "keys") -> None:
        self._own(np.array(_byte_matrix(matrix, name), np.uint8, order="C"), name)

    def _own(self, m: np.ndarray, name: str) -> None:
        """Check ``m`` (a C-ordered uint8 array this batch may keep) and keep it read-only."""
        if m.ndim != 2:
            raise ValueError(f"{name}: a key batch is an (n, width) uint8 matrix, got shape {m.shape}")
        n, width = m.shape
        if not 1 <= width <= MAX_KEY_BYTES:
            raise ValueError(f"{name}: keys of {width} bytes; pool keys are 1 to {MAX_KEY_BYTES} bytes")
        if n > MAX_BATCH:
            raise ValueError(f"{name} holds {n} keys; one request takes at most {MAX_BATCH}")
        if width >= 2 and b"\xff" in m[:, 0].tobytes():  # rare: only then look closely
            reserved = (m[:, 0] == RESERVED_PREFIX[0]) & (m[:, 1] == RESERVED_PREFIX[1])
            if reserved.any():
                i = int(np.argmax(reserved))
                raise ValueError(f"{name}[{i}]: {_key_problem(m[i].tobytes())}")
        m.flags.writeable = False
        self.matrix = m
        self._keys: list[bytes] | None = None

    @classmethod
    def of_ids(cls, prefix: bytes, ids: Any, suffix: bytes = b"", id_bytes: int = 16) -> KeyBatch:
        """The keys ``prefix + ids[i] + suffix``: ``ids`` an ``(n, id_bytes)`` uint8 array."""
        if not isinstance(prefix, bytes) or not isinstance(suffix, bytes):
            raise TypeError(
                f"prefix and suffix are bytes, got {type(prefix).__name__} and {type(suffix).__name__}"
            )
        a = _byte_matrix(ids, "ids")
        if a.ndim != 2 or a.shape[1] != id_bytes:
            raise ValueError(f"ids must be an (n, {id_bytes}) uint8 array, got shape {a.shape}")
        m = np.empty((a.shape[0], len(prefix) + id_bytes + len(suffix)), np.uint8)
        m[:] = np.frombuffer(prefix + bytes(id_bytes) + suffix, np.uint8)  # the fixed bytes
        m[:, len(prefix) : len(prefix) + id_bytes] = a
        return cls._owning(m, "ids")

    @classmethod
    def stack(cls, batches: Iterable[KeyBatch]) -> KeyBatch:
        """One batch of the keys of ``batches`` in turn (all of one width)."""
        parts = [b.matrix for b in batches]
        widths = {p.shape[1] for p in parts}
        if len(widths) > 1:
            raise ValueError(f"key batches of different widths cannot be stacked: {sorted(widths)}")
        return cls._owning(np.concatenate(parts) if parts else np.zeros((0, 1), np.uint8), "keys")

    @classmethod
    def _owning(cls, m: np.ndarray, name: str) -> KeyBatch:
        """A batch keeping ``m`` (just built, C-ordered uint8) without copying it."""
        batch = cls.__new__(cls)
        batch._own(m, name)
        return batch

    @property
    def width(self) -> int:
        return int(self.matrix.shape[1])

    def tolist(self) -> list[bytes]:
        """The keys as bytes (made once, in C, and kept)."""
        if self._keys is None:
            self._keys = self.matrix.view(f"V{self.width}").ravel().tolist()
        return self._keys

    def __len__(self) -> int:
        return int(self.matrix.shape[0])

    def __getitem__(self, i: int) -> bytes:
        return self.tolist()[i]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.tolist())

    def __repr__(self) -> str:
        return f"KeyBatch({len(self)} keys of {self.width} B)"


#: what the client's batch calls take as keys
Keys = Sequence[str | bytes] | KeyBatch


def _byte_matrix(values: Any, name: str) -> np.ndarray:
    """``values`` as uint8, refusing (naming the first bad index) what is not a byte."""
    a = np.asarray(values)
    if a.dtype == np.uint8:
        return a
    if a.dtype.kind not in "iu" or a.dtype == np.bool_:
        raise ValueError(f"{name}: expected bytes (a uint8 array), got an array of {a.dtype}")
    bad = (a < 0) | (a > 255)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        where = ", ".join(map(str, at))
        raise ValueError(f"{name}[{where}] = {int(a[at])}: must be a byte (0..255)")
    return a.astype(np.uint8)


def encode_key(key: object) -> bytes:
    """The key's bytes (a ``str``'s UTF-8); ``TypeError``/``ValueError`` naming the key when invalid."""
    if isinstance(key, str):
        try:
            raw = key.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"pool key {key[:40]!r} has no UTF-8 form: {e.reason}") from None
    elif isinstance(key, bytes):
        raw = key
    else:
        raise TypeError(f"pool keys are str or bytes, got {type(key).__name__}")
    problem = _key_problem(raw)
    if problem:
        raise ValueError(problem)
    return raw


def encode_keys(keys: object, name: str = "keys") -> list[bytes]:
    """A batch's keys as bytes: a :class:`KeyBatch` as it is (checked when built), else
    each key by ``encode_key``; errors name the first bad index (``keys[3]: ...``)."""
    if isinstance(keys, KeyBatch):
        return keys.tolist()
    if isinstance(keys, (str, bytes)):
        raise TypeError("batch operations take a list of keys, not a single key")
    out = []
    for i, k in enumerate(keys):  # type: ignore[attr-defined]
        try:
            out.append(encode_key(k))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}[{i}]: {e}") from None
    return out


def check_count(values: Sequence[Any], name: str) -> None:
    """A request list of at most ``MAX_BATCH`` items."""
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {type(values).__name__}")
    if len(values) > MAX_BATCH:
        raise ValueError(f"{name} holds {len(values)} items; one request takes at most {MAX_BATCH}")


def check_keys(keys: Sequence[Any], name: str = "keys") -> None:
    """Service side: every key is ``bytes`` of 1 to ``MAX_KEY_BYTES``; checked for the
    whole list at once, the first bad one named only when there is one."""
    check_count(keys, name)
    if not keys:
        return
    if set(map(type, keys)) == {bytes}:  # the whole list in C; the slow path names the culprit
        lens = list(map(len, keys))
        # no key starts with the reserved prefix when every key sorts below it
        if min(lens) > 0 and max(lens) <= MAX_KEY_BYTES and max(keys) < RESERVED_PREFIX:
            return
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
