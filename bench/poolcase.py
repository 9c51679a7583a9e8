"""The cases of ``kvfabric bench pool``: object shapes, operations, the plan of a run.

A :class:`Case` is one operation (put / get / exists) on objects of one :class:`Shape`
(a plain object, or one object gathered from many pieces), in calls of ``batch`` objects,
from ``clients`` processes at once. The same case runs against every store (the kvfabric
pool, Mooncake Store, Redis), so results match up by :attr:`Case.key`.

Buffer layout (:func:`piece_offsets`): a client's working set holds ``slots`` objects.
A plain object of slot ``s`` lies at ``s * nbytes``; a layered object is spread the way a
KV cache is, one region per piece (per layer tensor), piece ``j`` of slot ``s`` at
``region[j] + s * pieces[j]``. The memcpy baseline copies slot ``s`` as one contiguous
range of the same bytes.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# DeepSeek-R1 block as a KV connector stores it: 61 layers x (128 KiB + 16 KiB) pieces.
BLOCK_LAYERS = 61
BLOCK_PIECES: tuple[int, ...] = (128 * KiB, 16 * KiB) * BLOCK_LAYERS


class Op(str, enum.Enum):
    PUT = "put"
    GET = "get"
    EXISTS = "exists"


@dataclass(frozen=True)
class Shape:
    """An object: the sizes of the pieces it is gathered from (one piece: a plain object)."""

    name: str
    pieces: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(self.pieces)

    @property
    def layered(self) -> bool:
        return len(self.pieces) > 1

    @classmethod
    def plain(cls, nbytes: int) -> Shape:
        name = f"{nbytes // MiB}MiB" if nbytes % MiB == 0 else f"{nbytes // KiB}KiB"
        return cls(name, (nbytes,))


BLOCK = Shape(f"block{len(BLOCK_PIECES)}", BLOCK_PIECES)


@dataclass(frozen=True)
class Case:
    """One measured operation. ``condition`` names a deliberate machine state
    (``"other-core-busy"``: a spinning process keeps the other core busy)."""

    op: Op
    shape: Shape
    batch: int
    clients: int
    label: str = "object"  # object | block | latency | exists
    condition: str = ""

    def __post_init__(self) -> None:
        if self.batch < 1 or self.clients < 1:
            raise ValueError(f"case needs batch >= 1 and clients >= 1, got {self.batch}, {self.clients}")

    @property
    def key(self) -> tuple[str, str, str, int, int, str]:
        return (self.label, self.op.value, self.shape.name, self.batch, self.clients, self.condition)

    @property
    def api(self) -> str:
        """The kvfabric call this case times (``batch_get_into_layers`` ...)."""
        if self.op is Op.EXISTS:
            return "batch_exists"
        name = "put_from" if self.op is Op.PUT else "get_into"
        if self.shape.layered:
            name += "_layers"
        return f"batch_{name}" if self.batch > 1 else name


@dataclass(frozen=True)
class Plan:
    """What one run measures. ``working_set``: bytes of distinct memory the objects of
    a case occupy on each side (split among the clients); ``round_s``: target seconds of
    measured calls per round (calls per round are derived from a calibration call)."""

    working_set: int
    rounds: int
    round_s: float
    cases: tuple[Case, ...]
    exists_keys: int = 4096
    directory_objects: int = 1_000_000
    directory_fill: int = 1_000_000
    peers: tuple[str, ...] = ("mooncake", "redis")
    mooncake_embedded: bool = True

    def client_bytes(self, case: Case) -> int:
        """One client's working set: its share of ``working_set``, but at least one batch
        (four clients with batches of 32 blocks would not fit a quarter of 1 GiB)."""
        share = self.working_set // case.clients
        return share if case.op is Op.EXISTS else max(share, case.batch * case.shape.nbytes)

    def slots(self, case: Case) -> int:
        """Objects per client in the case's working set."""
        return slots_for(self.client_bytes(case), case.shape)

    def client_capacities(self) -> list[int]:
        """Buffer bytes each client process needs for every case it takes part in."""
        n = max(c.clients for c in self.cases)
        return [
            max(
                [self.working_set // (1 if w == 0 else n)]
                + [self.client_bytes(c) for c in self.cases if c.clients > w]
            )
            for w in range(n)
        ]

    def store_capacity(self, headroom: float = 1.25, extra: int = 16 * MiB) -> int:
        """Bytes a store needs: every client's working set at once, with headroom for
        allocation granularity, plus room for the ``batch_exists`` keys."""
        need = max([self.working_set] + [c.clients * self.client_bytes(c) for c in self.cases])
        return int(need * headroom) + extra


def slots_for(client_bytes: int, shape: Shape) -> int:
    """How many objects of ``shape`` fit ``client_bytes`` (0: not even one)."""
    return client_bytes // shape.nbytes


def build_cases(
    sizes: list[Shape], batches: list[int], clients: list[int], big_batch_max: int | None = None
) -> tuple[Case, ...]:
    """The object matrix, grouped by (shape, clients) so each group's objects are stored
    once for its get cases; then the latency cases and batch_exists. ``big_batch_max``
    drops batches above it for objects of 4 MiB and more (short runs)."""
    out: list[Case] = []
    for shape in sizes:
        for n in clients:
            for op in (Op.PUT, Op.GET):
                for b in batches:
                    if big_batch_max is not None and shape.nbytes >= 4 * MiB and b > big_batch_max:
                        continue
                    out.append(Case(op, shape, b, n, "block" if shape.layered else "object"))
            if n == 1 and shape.nbytes == 64 * KiB:
                for op in (Op.GET, Op.PUT):
                    out.append(Case(op, shape, 1, 1, "latency", "other-core-busy"))
    out.append(Case(Op.EXISTS, Shape.plain(KiB), 4096, 1, "exists"))
    return tuple(out)


def case_to_dict(case: Case) -> dict[str, Any]:
    d = asdict(case)
    d["op"] = case.op.value
    d["shape"] = {"name": case.shape.name, "pieces": list(case.shape.pieces)}
    return d


def case_from_dict(d: dict[str, Any]) -> Case:
    shape = Shape(d["shape"]["name"], tuple(int(x) for x in d["shape"]["pieces"]))
    return Case(Op(d["op"]), shape, int(d["batch"]), int(d["clients"]), d["label"], d["condition"])


def piece_offsets(shape: Shape, slots: int, idx: np.ndarray) -> np.ndarray:
    """Byte offsets ``(len(idx), pieces)`` of the pieces of objects ``idx`` in a buffer
    laid out for ``slots`` objects (see module docstring)."""
    p = np.asarray(shape.pieces, np.uint64)
    region = np.concatenate([[0], np.cumsum(p[:-1])]).astype(np.uint64) * np.uint64(slots)
    return region[None, :] + idx.astype(np.uint64)[:, None] * p[None, :]
