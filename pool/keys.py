"""Pool keys: non-empty strings of at most 256 UTF-8 bytes."""

from __future__ import annotations

MAX_KEY_BYTES = 256


def encode_key(key: object) -> bytes:
    """The key's UTF-8 bytes; ``TypeError``/``ValueError`` naming the key when invalid."""
    if isinstance(key, str):
        raw = key.encode("utf-8")
    elif isinstance(key, bytes):
        raw = key
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"pool key {key!r} is not valid UTF-8") from None
    else:
        raise TypeError(f"pool keys are str, got {type(key).__name__}")
    if not raw:
        raise ValueError("pool keys must not be empty")
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"pool key of {len(raw)} bytes is longer than {MAX_KEY_BYTES}: {raw[:40]!r}...")
    return raw


def encode_keys(keys: object) -> list[bytes]:
    if isinstance(keys, (str, bytes)):
        raise TypeError("batch operations take a list of keys, not a single key")
    return [encode_key(k) for k in keys]  # type: ignore[attr-defined]
