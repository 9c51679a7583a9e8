"""RPC messages between pool clients and the meta service (msgpack via msgspec).

One request, one reply. Batched requests carry parallel lists (keys, sizes, ...) and the
reply carries parallel per-key lists, so a batch of any size is one round trip. Replies
always carry the service ``epoch``: a client that sees it change knows the service
restarted and re-registers the objects its ranks own.

Keys are binary: any bytes, 1..256 of them (``keys.py``; a client's ``str`` keys travel
as their UTF-8, its ``KeyBatch`` keys as the batch's bytes, the same msgpack ``bin`` list).
Fields carry their wire-level bounds (key lengths, sizes > 0, ids and addresses in uint64,
at most ``MAX_BATCH`` items a list): a frame that breaks one is refused by the decoder
with the path of the bad field (``Expected `int` >= 1, got -1 - at `$.sizes[3]` ``). The
dispatcher checks the rest (key types and lengths again, matching list lengths, ranks and
addresses inside the pool's windows) for every caller, in-process ones included.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from kvfabric.pool.keys import MAX_BATCH, MAX_KEY_BYTES, RESERVED_PREFIX

# Wire-level bounds, checked by the decoder before a request reaches the service (the
# dispatcher checks the same and more again, also for in-process callers: ``dispatch.py``).
Key = Annotated[bytes, Meta(min_length=1, max_length=MAX_KEY_BYTES)]
Keys = Annotated[list[Key], Meta(max_length=MAX_BATCH)]
U64 = Annotated[int, Meta(ge=0)]  # the decoder refuses ints past 2**64 - 1 itself
U64s = Annotated[list[U64], Meta(max_length=MAX_BATCH)]
Sizes = Annotated[list[Annotated[int, Meta(gt=0)]], Meta(max_length=MAX_BATCH)]
Rank = Annotated[int, Meta(ge=0)]
ClientId = Annotated[str, Meta(max_length=MAX_KEY_BYTES)]
MAX_FRAME = 1 << 29  # bytes of one request frame; a longer one closes the connection
#: how a ``Reply.error`` starts when the service does not lead its pool (a standby, or a
#: leader whose etcd lease may have run out): the client looks the leader up and retries
NOT_LEADER = "not the leader"
#: replicas (``pool/service/replicas.py``): copies of an object, and the reserved directory
#: key of its further extent ``i`` (readers on the node probe them after the primary)
MAX_REPLICAS = 8
REPLICA_PREFIX = RESERVED_PREFIX + b"r"  # + one byte: the extent's index (1 .. MAX_REPLICAS - 1)


def check_replicas(value: object, name: str = "replicas") -> int:
    """``value`` as a replica count (1 .. ``MAX_REPLICAS``); ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} = {value!r}: must be an integer in [1, {MAX_REPLICAS}]")
    if not 1 <= value <= MAX_REPLICAS:
        raise ValueError(f"{name} = {value}: must be in [1, {MAX_REPLICAS}] (copies of each object)")
    return value


def replica_key(key: bytes, index: int) -> bytes:
    """The directory key of extent ``index`` (>= 1) of ``key``."""
    return REPLICA_PREFIX + bytes((index,)) + key


class Hello(msgspec.Struct, tag="hello", frozen=True):
    client: ClientId
    token: ClientId = ""


class Info(msgspec.Struct, tag="info", frozen=True):
    pass


class Alloc(msgspec.Struct, tag="alloc", frozen=True):
    """Space for ``keys`` (``sizes`` bytes each) under a write lease of ``client``."""

    client: ClientId
    keys: Keys
    sizes: Sizes
    home_rank: Rank | None = None
    preferred_rank: Rank | None = None
    medium: str | None = None
    #: extents per key on distinct nodes (None: the pool's ``replicas``); the reply's
    #: ``replicas`` lists the further extents' gvas, which the writer fills as well
    replicas: Annotated[int, Meta(ge=1)] | None = None


class Commit(msgspec.Struct, tag="commit", frozen=True):
    client: ClientId
    keys: Keys
    ok: Annotated[list[bool], Meta(max_length=MAX_BATCH)]
    ttl_s: Annotated[float, Meta(ge=0)] | None = None
    sums: U64s | None = None  # the writer's checksum per object (platform.checksum; 0: none)


class Renew(msgspec.Struct, tag="renew", frozen=True):
    """Extend the caller's write leases on ``keys`` (a long copy is still in flight)."""

    client: ClientId
    keys: Keys


class Lookup(msgspec.Struct, tag="lookup", frozen=True):
    keys: Keys
    lease: bool = True


class Release(msgspec.Struct, tag="release", frozen=True):
    lease_ids: U64s


class Exists(msgspec.Struct, tag="exists", frozen=True):
    keys: Keys


class Remove(msgspec.Struct, tag="remove", frozen=True):
    keys: Keys
    gvas: U64s | None = None  # only that extent of each key (a replica found corrupt)


class Held(msgspec.Struct, tag="held", frozen=True):
    """The committed extents in ``rank``'s windows (its owner's list to re-register)."""

    rank: Rank


class RemoveAll(msgspec.Struct, tag="remove_all", frozen=True):
    pass


class Reregister(msgspec.Struct, tag="reregister", frozen=True):
    """Objects a client's own window holds, told again to a restarted service."""

    keys: Keys
    gvas: U64s
    sizes: Sizes
    gens: U64s
    sums: U64s | None = None


class ListKeys(msgspec.Struct, tag="list_keys", frozen=True):
    prefix: Annotated[bytes, Meta(max_length=MAX_KEY_BYTES)] = b""
    start: Annotated[int, Meta(ge=0)] = 0
    limit: Annotated[int, Meta(ge=0)] = 1000


Request = (
    Hello
    | Info
    | Alloc
    | Commit
    | Renew
    | Lookup
    | Release
    | Exists
    | Remove
    | RemoveAll
    | Reregister
    | ListKeys
    | Held
)


class Reply(msgspec.Struct, frozen=True, omit_defaults=True):
    epoch: int
    error: str = ""  # a request the service refused as a whole (bad argument, bad token)
    status: list[int] = []  # per key: a kvfabric.status.ItemStatus value (pool names: pool.status)
    gvas: list[int] = []
    sizes: list[int] = []
    gens: list[int] = []
    lease_ids: list[int] = []
    sums: list[int] = []  # lookup: the writer's checksum per key (0: none recorded)
    replicas: list[list[int]] = []  # alloc / lookup: per key, the gvas of its further extents
    keys: list[bytes] = []  # held: the keys of the extents listed in gvas / sizes / gens / sums
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
