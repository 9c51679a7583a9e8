"""RPC messages between pool clients and the meta service (msgpack via msgspec).

One request, one reply. Batched requests carry parallel lists (keys, sizes, ...) and the
reply carries parallel per-key lists, so a batch of any size is one round trip. Replies
always carry the service ``epoch``: a client that sees it change knows the service
restarted and re-registers the objects its ranks own.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Hello(msgspec.Struct, tag="hello", frozen=True):
    client: str
    token: str = ""


class Info(msgspec.Struct, tag="info", frozen=True):
    pass


class Alloc(msgspec.Struct, tag="alloc", frozen=True):
    client: str
    keys: list[bytes]
    sizes: list[int]
    home_rank: int | None = None
    preferred_rank: int | None = None
    medium: str | None = None


class Commit(msgspec.Struct, tag="commit", frozen=True):
    client: str
    keys: list[bytes]
    ok: list[bool]
    ttl_s: float | None = None


class Lookup(msgspec.Struct, tag="lookup", frozen=True):
    keys: list[bytes]
    lease: bool = True


class Release(msgspec.Struct, tag="release", frozen=True):
    lease_ids: list[int]


class Exists(msgspec.Struct, tag="exists", frozen=True):
    keys: list[bytes]


class Remove(msgspec.Struct, tag="remove", frozen=True):
    keys: list[bytes]


class RemoveAll(msgspec.Struct, tag="remove_all", frozen=True):
    pass


class Reregister(msgspec.Struct, tag="reregister", frozen=True):
    keys: list[bytes]
    gvas: list[int]
    sizes: list[int]
    gens: list[int]


class ListKeys(msgspec.Struct, tag="list_keys", frozen=True):
    prefix: bytes = b""
    start: int = 0
    limit: int = 1000


Request = (
    Hello | Info | Alloc | Commit | Lookup | Release | Exists | Remove | RemoveAll | Reregister | ListKeys
)


class Reply(msgspec.Struct, frozen=True, omit_defaults=True):
    epoch: int
    error: str = ""  # a request the service refused as a whole (bad argument, bad token)
    status: list[int] = []
    gvas: list[int] = []
    sizes: list[int] = []
    gens: list[int] = []
    lease_ids: list[int] = []
    flags: list[bool] = []
    data: dict[str, Any] = {}


_enc = msgspec.msgpack.Encoder()
_req_dec = msgspec.msgpack.Decoder(Request)
_rep_dec = msgspec.msgpack.Decoder(Reply)


def encode(msg: Any) -> bytes:
    return _enc.encode(msg)


def decode_request(data: bytes) -> Any:
    return _req_dec.decode(data)


def decode_reply(data: bytes) -> Reply:
    return _rep_dec.decode(data)
