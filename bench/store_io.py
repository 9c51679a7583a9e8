"""Helpers of ``kvfabric bench store``: KV-cache-shaped buffers, plain file I/O, CPU load,
and the block-hashing comparison with vLLM."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvfabric.bench.report import BenchContext, cpu_busy_fraction, read_cpu_row
from kvfabric.platform.base import Platform
from kvfabric.platform.types import Medium
from kvfabric.ucm_layer.hashing import BlockHasher, Fingerprint
from kvfabric.ucm_layer.store.base import StoreLayout

PROMPT_TOKENS = 128 * 1024


class LayerBuffers:
    """One device buffer per piece (as vLLM keeps one KV tensor per layer; ``medium=DRAM``:
    host memory, as the CPU engine's KV cache is), ``blocks`` blocks each; ``addrs[b, p]``
    is block ``b``'s slice of tensor ``p``. Filled (pre-touched) with a pattern, or zeros
    when ``seed`` is None."""

    def __init__(
        self, plat: Platform, layout: StoreLayout, blocks: int, seed: int | None, medium: Medium = Medium.HBM
    ) -> None:
        self.plat = plat
        self.sizes = layout.piece_sizes
        self.bufs = [plat.alloc(blocks * s, medium) for s in self.sizes]
        biggest = max(b.nbytes for b in self.bufs)
        host = plat.alloc(biggest, Medium.DRAM)
        rng = np.random.default_rng(seed or 0)
        h = host.numpy()
        h[:] = 0 if seed is None else rng.integers(0, 256, biggest, dtype=np.uint8)
        for b in self.bufs:
            plat.copy(b, host.at(0, b.nbytes))
        plat.free(host)
        self.addrs = np.stack(
            [
                b.ptr + np.arange(blocks, dtype=np.uint64) * np.uint64(s)
                for b, s in zip(self.bufs, self.sizes)
            ],
            axis=1,
        ).astype(np.uint64)

    def sample(self) -> np.ndarray:
        """The bytes of the first and last tensors, for a correctness check."""
        out = []
        for b in (self.bufs[0], self.bufs[-1]):
            host = self.plat.alloc(b.nbytes, Medium.DRAM)
            self.plat.copy(host, b)
            out.append(host.numpy().copy())
            self.plat.free(host)
        return np.concatenate(out)

    def free(self) -> None:
        for b in self.bufs:
            self.plat.free(b)


class CpuMeter:
    """How many cores' worth of work *other* processes did since construction."""

    def __init__(self) -> None:
        self._row = read_cpu_row()
        self._t = time.perf_counter()
        self._cpu = sum(os.times()[:2])

    def other_cores_busy(self) -> float:
        wall = time.perf_counter() - self._t
        if wall <= 0:
            return 0.0
        total = cpu_busy_fraction((self._row, read_cpu_row())) * (os.cpu_count() or 1)
        ours = (sum(os.times()[:2]) - self._cpu) / wall
        return round(max(0.0, total - ours), 2)


def plain_read(paths: list[str], host: np.ndarray) -> None:
    """``cp``-style: read each file whole into one reused host buffer."""
    view = memoryview(host)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            done = 0
            while done < len(view):
                n = os.readv(fd, [view[done:]])
                if n <= 0:
                    break
                done += n
        finally:
            os.close(fd)


def plain_write(directory: str, host: np.ndarray, count: int) -> None:
    """Write ``count`` new files holding ``host``'s bytes (open, write, close; as ``cp`` does)."""
    os.makedirs(directory, exist_ok=True)
    for i in range(count):
        fd = os.open(os.path.join(directory, f"f{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, host)
        finally:
            os.close(fd)


def _median_time(fn: Any, rounds: int) -> tuple[float, Any]:
    out, ts = None, []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:]), out


def hashing_rows(ctx: BenchContext) -> Iterator[dict[str, Any]]:
    """Tokens/s of block hashing for a 128K-token prompt, ours next to vLLM's."""
    rounds = max(ctx.rounds, 5)
    tokens = np.random.default_rng(5).integers(0, 150_000, PROMPT_TOKENS).tolist()
    try:
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils as kv

        kv.init_none_hash(sha256)
    except ImportError:
        kv = None
    for bs in (16, 128):
        hasher = BlockHasher(Fingerprint("bench-model", "bfloat16", "2x28x64KiB", block_size=bs))
        t_ours, ids = _median_time(lambda h=hasher: h.hash_tokens(tokens), rounds)
        row: dict[str, Any] = {
            "store": "-",
            "op": "hash_tokens",
            "block_size": bs,
            "tokens": PROMPT_TOKENS,
            "blocks": int(ids.shape[0]),
            "tokens_per_s": round(PROMPT_TOKENS / t_ours),
            "p50_us": round(t_ours * 1e6, 1),
        }
        if kv is None:
            row["vllm"] = "not installed: no comparison"
            yield row
            continue

        def vllm_chain(bs: int = bs) -> list[bytes]:
            parent, out = None, []
            for i in range(len(tokens) // bs):
                parent = kv.hash_block_tokens(sha256, parent, tokens[i * bs : (i + 1) * bs], None)
                out.append(parent)
            return out

        t_vllm, hashes = _median_time(vllm_chain, rounds)
        row["vllm_tokens_per_s"] = round(PROMPT_TOKENS / t_vllm)
        row["ratio_vs_vllm"] = round(t_vllm / t_ours, 3)
        yield row
        t_eng, _ = _median_time(lambda h=hasher, hs=hashes: h.hash_engine(hs), rounds)
        yield {
            "store": "-",
            "op": "hash_engine",
            "block_size": bs,
            "tokens": PROMPT_TOKENS,
            "blocks": len(hashes),
            "tokens_per_s": round(PROMPT_TOKENS / t_eng),
            "p50_us": round(t_eng * 1e6, 1),
            "vllm_tokens_per_s": round(PROMPT_TOKENS / t_vllm),
            "ratio_vs_vllm": round(t_vllm / t_eng, 3),
        }
