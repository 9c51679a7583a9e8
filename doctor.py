"""``kvfabric doctor``: why is my hit rate zero?

Three checks, each a :class:`Finding` (``ok``, ``failed`` or ``skipped``, with what was found):

``hashing``
    Block ids must not depend on the process: the same tokens and engine block hashes are
    hashed here and in two fresh interpreters with different ``PYTHONHASHSEED`` values,
    and the ids must be identical (a process-dependent id never hits another process's
    blocks).
``fingerprint``
    Two engines share blocks only when their fingerprints are equal (model, KV dtype, KV
    layout, block size, TP size, salt: docs/hashing.md). Each ``--fingerprint`` source is
    a JSON file of the fields, or a log holding the connector's start-up line
    ``kvfabric: block ids use fingerprint <hex> {...}``; every source is compared with the
    first and the fields that differ are named with both values.
``store``
    With ``--config FILE`` (the connector's YAML, as its ``config_file``): the store it
    names is built as a worker would (a pool on ``auto`` is started or joined), one block
    with a fresh random id is dumped, looked up and loaded back, and its bytes compared.

Nothing here changes what the engines store beyond that one block. The exit status of
the command is 1 when a check failed.
"""

from __future__ import annotations

import enum
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvfabric.ucm_layer.hashing import BlockHasher, Fingerprint

REFERENCE = Fingerprint("kvfabric-doctor", "float16", "doctor-layout", 16, 1, "doctor")
BLOCK_BYTES = 4096
FINGERPRINT_MARK = "block ids use fingerprint"


class Outcome(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Finding:
    """What one check found."""

    check: str
    outcome: Outcome
    detail: str

    def as_json(self) -> dict[str, str]:
        return {"check": self.check, "outcome": self.outcome.value, "detail": self.detail}


def reference_ids() -> str:
    """Hex of the ids of fixed tokens and engine hashes under :data:`REFERENCE`."""
    hasher = BlockHasher(REFERENCE)
    tokens = hasher.hash_tokens(list(range(8 * REFERENCE.block_size)))
    engine = hasher.hash_engine([b"\x01" * 32, b"\x02" * 32, 7])
    return np.concatenate([tokens, engine]).tobytes().hex()


def check_hashing(seeds: Sequence[str] = ("1", "2")) -> Finding:
    here = reference_ids()
    code = "from kvfabric.doctor import reference_ids; print(reference_ids())"
    for seed in seeds:
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
        )
        if out.returncode != 0:
            return Finding(
                "hashing", Outcome.FAILED, f"a fresh interpreter could not hash: {out.stderr.strip()[-300:]}"
            )
        if out.stdout.strip() != here:
            return Finding(
                "hashing",
                Outcome.FAILED,
                f"a process with PYTHONHASHSEED={seed} computes other block ids than this one: "
                "ids depend on the process, so no process hits another's blocks",
            )
    return Finding(
        "hashing",
        Outcome.OK,
        f"the same block ids in this process and {len(seeds)} fresh ones (hash seeds {', '.join(seeds)})",
    )


def read_fingerprint(path: str | Path) -> Fingerprint:
    """A fingerprint from a JSON file of its fields or from a log with the connector's
    start-up line (the last such line wins); ``ValueError`` naming the file otherwise."""
    text = Path(path).read_text()
    try:
        return Fingerprint.from_mapping(json.loads(text))
    except json.JSONDecodeError:
        pass
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    lines = [line for line in text.splitlines() if FINGERPRINT_MARK in line and "{" in line]
    if not lines:
        raise ValueError(f"{path}: neither a JSON fingerprint nor a log with a {FINGERPRINT_MARK!r} line")
    line = lines[-1]
    try:
        return Fingerprint.from_mapping(json.loads(line[line.index("{") : line.rindex("}") + 1]))
    except (json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"{path}: the fingerprint line does not parse: {e}") from None


def check_fingerprints(paths: Sequence[str | Path]) -> Finding:
    if len(paths) < 2:
        return Finding("fingerprint", Outcome.SKIPPED, "give two or more --fingerprint sources to compare")
    try:
        prints = [read_fingerprint(p) for p in paths]
    except (OSError, ValueError) as e:
        return Finding("fingerprint", Outcome.FAILED, str(e))
    first = prints[0].to_mapping()
    problems = []
    for path, fp in zip(paths[1:], prints[1:], strict=True):
        other = fp.to_mapping()
        diff = [
            f"{k}: {first[k]!r} ({paths[0]}) vs {other[k]!r} ({path})" for k in first if first[k] != other[k]
        ]
        if diff:
            problems.append("; ".join(diff))
    if problems:
        return Finding(
            "fingerprint",
            Outcome.FAILED,
            "the engines' block ids never meet: " + " | ".join(problems),
        )
    return Finding(
        "fingerprint", Outcome.OK, f"{len(prints)} fingerprints equal ({prints[0].digest().hex()[:16]})"
    )


def check_store(config_file: str | None) -> Finding:
    if not config_file:
        return Finding("store", Outcome.SKIPPED, "give --config FILE (the connector's YAML) to try its store")
    from kvfabric.platform.registry import create as create_platform
    from kvfabric.platform.types import Medium
    from kvfabric.status import ItemStatus
    from kvfabric.ucm_layer.connector import stores
    from kvfabric.ucm_layer.connector.config import load_config
    from kvfabric.ucm_layer.store.base import StoreLayout

    try:
        cfg = load_config({"config_file": config_file}).placed(one_process=False)
    except (OSError, ValueError, TypeError) as e:
        return Finding("store", Outcome.FAILED, f"the configuration does not load: {e}")
    plat = create_platform()
    store = None
    try:
        store = stores.build(cfg, plat, StoreLayout((BLOCK_BYTES,)))
        ids = np.frombuffer(os.urandom(16), np.uint8).reshape(1, 16).copy()
        src, dst = plat.alloc(BLOCK_BYTES, Medium.DRAM), plat.alloc(BLOCK_BYTES, Medium.DRAM)
        src.numpy()[:] = np.frombuffer(os.urandom(BLOCK_BYTES), np.uint8)
        dst.numpy()[:] = 0
        st = store.wait(store.dump(ids, 0, np.array([[src.ptr]], np.uint64)), 30)
        if st.tolist() != [ItemStatus.OK]:
            return Finding("store", Outcome.FAILED, f"{cfg.store}: a dump of one block failed ({_names(st)})")
        if not store.lookup(ids).all():
            return Finding(
                "store", Outcome.FAILED, f"{cfg.store}: a block just dumped is not found by lookup"
            )
        st = store.wait(store.load(ids, 0, np.array([[dst.ptr]], np.uint64)), 30)
        if st.tolist() != [ItemStatus.OK]:
            return Finding(
                "store", Outcome.FAILED, f"{cfg.store}: loading a block just dumped failed ({_names(st)})"
            )
        if not np.array_equal(src.numpy(), dst.numpy()):
            return Finding(
                "store", Outcome.FAILED, f"{cfg.store}: a block loaded back differs from what was dumped"
            )
        return Finding(
            "store",
            Outcome.OK,
            f"{cfg.store}: one {BLOCK_BYTES} B block dumped, found and loaded back, bytes equal",
        )
    except Exception as e:  # noqa: BLE001 - what went wrong is the finding
        return Finding("store", Outcome.FAILED, f"{cfg.store}: {type(e).__name__}: {e}")
    finally:
        if store is not None:
            store.close()
        plat.close()


def _names(statuses: Any) -> str:
    from kvfabric.status import ItemStatus

    return ", ".join(ItemStatus(int(s)).name for s in np.asarray(statuses).ravel())


def run(fingerprints: Sequence[str] = (), config_file: str | None = None) -> list[Finding]:
    """Every check, in order (see module docstring)."""
    return [check_hashing(), check_fingerprints(list(fingerprints)), check_store(config_file)]
