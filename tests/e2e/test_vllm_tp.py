"""The connector under tensor parallelism: a real vLLM engine on CPU, TP=2 (vLLM's ``mp``
executor, one worker process per rank), the tiny Llama (2 KV heads: one per rank), the
posix store, asynchronous loads.

Each rank stores its own heads under ids tagged with its rank; the scheduler (in this
process) counts a block as hit only when every rank holds it. What is proven:

* The same prompt twice: the second run loads every full block on both ranks
  (``num_cached_tokens``) and its tokens are the cold run's.
* A block whose file is corrupt on rank 1 only (same-size noise, its checksum fails)
  is recomputed: the tokens are still the cold run's, rank 0's copy of that block is
  left in place, rank 1's is written again, and a third run hits every block.
* A rank whose store stalls (rank 1's file of one block is a FIFO, so its read blocks
  in ``open``) does not hang the engine: the load times out after ``load_timeout_s``
  on that rank and the request finishes in bounded time with the cold run's tokens.
  Once the read is unblocked the store drops the FIFO (0 B). Rank 1 does not read a
  copy whose load timed out again for a while (the worker's stall hold), so the next
  runs never wait on it: they compute from there, write the block again and give the
  cold run's tokens.

One engine serves every case (a TP=2 start costs ~40 s here); each case has a prompt
of its own. Dumps run in the rank processes, so the tests wait for them by watching
the store's directory for the block files they expect.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvfabric.harness.engine import BLOCK_SIZE, Engine, kvfabric_transfer_config, make_engine
from kvfabric.ucm_layer import hashing
from kvfabric.ucm_layer.store.posix_files import BlockFiles

TP = 2
PROMPT_LEN = 300
FULL_BLOCKS = (PROMPT_LEN - 1) // BLOCK_SIZE  # the last prompt token's block is never loaded
LOAD_TIMEOUT_S = 3.0
MAX_TOKENS = 12


class RecordIds:
    """Wraps the scheduler role's id function: keeps the ids it made, in order, so a test
    knows which file holds which block of its prompt."""

    def __init__(self, fn: Callable[[Any, Any], Any]) -> None:
        self.fn, self.rows = fn, []

    def __call__(self, hashes: Any, parent: Any) -> Any:
        out = self.fn(hashes, parent)
        self.rows.extend(out)
        return out


@dataclass
class TPEngine:
    eng: Engine
    sched: Any
    record: RecordIds
    files: BlockFiles


@pytest.fixture(scope="module")
def tp(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TPEngine]:
    store_dir = tmp_path_factory.mktemp("tp-store")
    cfg = kvfabric_transfer_config("posix", store_dir, load_timeout_s=LOAD_TIMEOUT_S)
    eng = make_engine(tiny_model, cfg, kv_bytes=64 << 20, max_model_len=1024, tensor_parallel_size=TP)
    try:
        assert eng.worker() is None  # the workers are the rank processes
        sched = next(c.scheduler for c in eng.connectors() if c.scheduler is not None)
        record = sched._ids_from_hashes = RecordIds(sched._ids_from_hashes)
        yield TPEngine(eng, sched, record, BlockFiles([str(store_dir)]))
    finally:
        eng.close()


def _prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 512, PROMPT_LEN).tolist()


def _run(eng: Engine, prompt: list[int]) -> tuple[list[int], int]:
    """Tokens of one greedy request and its prompt tokens the connector loaded."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = eng.llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def _cold(tp: TPEngine, prompt: list[int]) -> tuple[list[int], list[list[Path]]]:
    """The cold run's tokens and, per rank, its block files in prompt order (waited for)."""
    start = len(tp.record.rows)
    tokens, cached = _run(tp.eng, prompt)
    assert cached == 0
    ids = np.stack(tp.record.rows[start : start + FULL_BLOCKS])
    files = [[Path(p) for p in tp.files.paths(hashing.tag(ids, r, 0))] for r in range(TP)]
    assert len({f for rank in files for f in rank}) == TP * FULL_BLOCKS  # rank ids differ
    _wait_files([f for rank in files for f in rank])
    return tokens, files


def _wait_files(paths: list[Path], timeout: float = 60.0) -> None:
    """Until every path is a complete regular block file (the rank processes dump)."""
    deadline = time.monotonic() + timeout
    while True:
        missing = [p for p in paths if not _is_block_file(p)]
        if not missing:
            return
        assert time.monotonic() < deadline, f"{len(missing)} block files not written: {missing[:2]}"
        time.sleep(0.05)


def _is_block_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except FileNotFoundError:
        return False


def _noise(path: Path, seed: int) -> None:
    """Noise over the file's first half (block data, never the trailer): same size, and
    the checksum the trailer records no longer matches."""
    size = path.stat().st_size
    data = np.random.default_rng(seed).integers(0, 256, size // 2, dtype=np.uint8).tobytes()
    with open(path, "r+b") as fh:
        assert os.pwrite(fh.fileno(), data, 0) == len(data)
    assert path.stat().st_size == size


def test_same_prompt_twice_loads_every_block_on_both_ranks(tp: TPEngine) -> None:
    prompt = _prompt(1)
    cold, _ = _cold(tp, prompt)
    again, cached = _run(tp.eng, prompt)
    assert again == cold
    assert cached == FULL_BLOCKS * BLOCK_SIZE


def test_a_block_corrupt_on_one_rank_is_recomputed_and_written_again(tp: TPEngine) -> None:
    prompt = _prompt(2)
    cold, files = _cold(tp, prompt)
    bad = FULL_BLOCKS // 2
    rank0, rank1 = files[0][bad], files[1][bad]
    rank0_before = (rank0.stat().st_ino, rank0.read_bytes())
    rank1_before = rank1.read_bytes()
    _noise(rank1, seed=3)
    repairs = tp.sched.stats.totals.get("repair_blocks", 0)

    again, _ = _run(tp.eng, prompt)  # num_cached_tokens: the lookup's, before the failure
    assert again == cold
    # vLLM recomputes from the bad block on; the scheduler sets those blocks back
    assert tp.sched.stats.totals.get("repair_blocks", 0) - repairs == FULL_BLOCKS - bad
    _wait_files([rank1])
    assert rank1.read_bytes() == rank1_before  # rank 1 wrote its block again, same bytes
    assert (rank0.stat().st_ino, rank0.read_bytes()) == rank0_before  # rank 0's copy kept

    third, cached = _run(tp.eng, prompt)
    assert third == cold
    assert cached == FULL_BLOCKS * BLOCK_SIZE


def _unblock(fifo: Path, timeout: float = 10.0) -> bool:
    """Open ``fifo`` for writing and close it, so a reader blocked in ``open`` returns
    (it then reads nothing). True when a reader was waiting; False when none came."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO or time.monotonic() > deadline:  # ENXIO: no reader yet
                return False
            time.sleep(0.05)
            continue
        os.close(fd)
        return True


def test_a_stalled_rank_times_out_and_the_engine_does_not_hang(tp: TPEngine, tmp_path: Path) -> None:
    prompt = _prompt(4)
    cold, files = _cold(tp, prompt)
    slow = FULL_BLOCKS // 2
    block = files[1][slow]
    fifo = tmp_path / "stall.fifo"  # outside the store: still reachable once replaced
    os.mkfifo(fifo)
    block.unlink()
    os.link(fifo, block)  # rank 1's file of the block is now the FIFO
    repairs = tp.sched.stats.totals.get("repair_blocks", 0)
    stuck = False
    try:
        t0 = time.monotonic()
        again, _ = _run(tp.eng, prompt)
        secs = time.monotonic() - t0
        stuck = _unblock(fifo)
    finally:
        if not stuck:
            _unblock(fifo, timeout=0.5)
    assert stuck, "rank 1's read never opened the FIFO"
    assert again == cold
    assert LOAD_TIMEOUT_S <= secs < 60.0
    # the load timed out: vLLM recomputes at least from the stalled block on (rank 1's
    # blocks its store had not reported by the deadline all fail as TIMEOUT)
    assert FULL_BLOCKS - slow <= tp.sched.stats.totals.get("repair_blocks", 0) - repairs <= FULL_BLOCKS
    # the dumps of the rerun kept the name (the posix store skips a block whose file
    # exists); the read, unblocked, finds 0 B and drops the FIFO (CORRUPT)
    _wait_gone(block)

    # rank 1 does not read the copy that timed out again for a while (the worker's stall
    # hold): later runs never wait for it, they compute from there, same tokens. Planted
    # again as a FIFO, a read of it would block in open() until the deadline: no reader
    # may come (a timing bound here read 2.51 s against 2.36 s on a quiet machine)
    fifo2 = tmp_path / "stall2.fifo"
    os.mkfifo(fifo2)
    os.link(fifo2, block)
    third, _ = _run(tp.eng, prompt)
    read_again = _unblock(fifo2, timeout=0.5)
    assert not read_again, "rank 1 read the stalled copy again within the stall hold"
    assert third == cold
    block.unlink()  # the planted FIFO: the posix store skips a name that exists
    fourth, _ = _run(tp.eng, prompt)
    assert fourth == cold
    _wait_files([block])  # recomputed and written again
    assert block.stat().st_size == files[0][slow].stat().st_size
    fifth, _ = _run(tp.eng, prompt)
    assert fifth == cold


def _wait_gone(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while os.path.lexists(path):
        assert time.monotonic() < deadline, f"{path} is still there"
        time.sleep(0.05)
