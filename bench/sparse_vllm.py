"""``kvfabric bench sparse-vllm [--quick] [--json]``: kvfabric's sparse attention backend
inside a vLLM engine (CPU build), against the stock backend in the same run.

What runs can be narrowed with ``KVFABRIC_BENCH_SPARSE_VLLM`` (JSON, :class:`RunConfig`):
``{"cases": ["tiny"]}`` (the tiny Llama only; ``"smollm2"`` the passkey groups only),
``tiny_context`` / ``tiny_prompts`` / ``tiny_budget`` (2,048), ``smollm2_contexts`` /
``smollm2_prompts`` / ``smollm2_budget`` (1,024),
``methods`` (sparse registry names), ``options`` (more keys for every sparse engine's
``KVFABRIC_SPARSE``; rows then carry them and are not ``"default"``) and ``rounds`` (1:
dense, then each method once; more: each method that many times, every run between two
dense runs, :func:`run_order`; a speed row's ``dense_step_ms`` is then the geometric mean
of the dense runs on either side of each run, ``speedup_vs_dense`` the median of those
per-run ratios, listed in ``speedup_vs_dense_runs``: on a shared machine whose load
drifts between engines, the flanked ratio is the one to quote).

Engines are built one at a time with :func:`kvfabric.harness.engine.make_engine` (in
process, eager, float32, 32-token blocks, prefix cache off); the sparse engine gets its
configuration through ``KVFABRIC_SPARSE`` (``algorithm``, ``budget_tokens``, ``stats_path``;
every other option at the algorithm's default, so ``gsa`` is GSA's default configuration).

Every engine serves groups of prompts at once through ``LLMEngine.step()`` (:func:`serve`),
each step timed: the steps in which every request of a group decodes give the step time
at the group's batch, and the last request, given ``tail`` more tokens, decodes alone at
the end: its steps give batch 1. Dense (the stock backend) and each method serve the same
groups, after one untimed warm-up group of short prompts (first calls of each batch shape)
and the same short group again, timed (``dense_short_step_ms``).

Rows (every one has ``engine, model, context, budget, batch, method, default, step_ms,
dense_step_ms, speedup_vs_dense, answers_match_dense, passkeys_lost, kl_mean, kl_max``;
fields a case does not measure are None; ``context`` is the group's mean prompt length):

* ``case: "accuracy"``: SmolLM2-135M-Instruct on passkey prompts (:func:`prompt_specs`:
  depths, seeds, filler texts and needle formats), a group of 8 at ~4.3K tokens (above
  GSA's 4,096-token switch) and one at ~7.5K (``--quick``: the ~4.3K group), greedy, 8 new
  tokens, budget 1,024; per method and group: ``dense_found`` / ``found`` (the key is the
  answer's first number), ``passkeys_lost`` (found by dense, missed by the method),
  ``answers_match_dense`` (fraction of prompts whose 8 tokens equal dense's). KL: vLLM's
  prefill is dense in both engines (the switch keeps prefill dense), so the first generated
  token has the same distribution; the first token computed by sparse attention is the
  second one (position 1, same prefix in both when the first tokens agree, which they do
  bit for bit). ``kl_mean`` / ``kl_max`` are KL(dense || method) there, from vLLM's
  top-``TOP_LOGPROBS`` logprobs (``SamplingParams(logprobs=20)``, vLLM's default cap): the
  two distributions coarsened to the tokens in both top-k lists plus one bucket for the
  rest (a lower bound of the full-vocabulary KL, equal to it when the rest holds no mass);
  ``kl_outside_mass_max`` is dense's largest mass outside the shared tokens.
* ``case: "speed"``: ``step_ms`` / ``dense_step_ms`` (medians; ``step_ms_mean`` /
  ``dense_step_ms_mean`` the means) at the group's batch and at batch 1, ``reuse_steps``
  (how many steps a layer's selection was kept), ``dense_short_step_ms`` (the stock
  engine's step at the group's batch over 256-token prompts, after the warm-up: what a step
  costs besides long-context attention, so ``dense_step_ms / dense_short_step_ms`` bounds
  any attention speed-up), for SmolLM2's groups (budget 1,024) and 8 random-token prompts of
  ``TINY_CONTEXT`` tokens on the random-weight tiny Llama (budget 2,048). Compute saved is
  ``kv_read_frac`` (``blocks_selected / blocks_total`` of the backend's stats over the
  group: the KV blocks the sparse kernel read against what dense attention reads there)
  and ``kv_bytes_per_step`` / ``dense_kv_bytes_per_step`` (those blocks in bytes, K and V,
  all layers and KV heads, per decode step at that batch; a (request, layer) step the
  switch left dense counts all its blocks). Memory saved is ``kv_memory_saved_bytes``: 0,
  vLLM allocates every block of a running request and the backend only reads fewer of them
  (offloading needs a scheduler hook, docs/sparse.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfabric.bench.flank import adjacent_means, flanked_schedule
from kvfabric.bench.report import BenchContext, machine_note
from kvfabric.bench.sparse.passkeys import FirstDecode, accuracy, build_prompt, prompt_specs

BLOCK = 32
NEW_TOKENS = 8
TOP_LOGPROBS = 20
#: the random-weight Llama's prompt length (tokens)
TINY_CONTEXT = 32768
#: SmolLM2's passkey groups (prompt tokens; 8 prompts each)
SMOLLM2_CONTEXTS = (4300, 7500)
#: the methods measured unless ``options["methods"]`` names others (sparse registry names)
METHODS = ("gsa",)


# ---------------------------------------------------------------------- engines
def _say(msg: str) -> None:
    print(f"[sparse-vllm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class RunConfig:
    """What :func:`run` measures (``KVFABRIC_BENCH_SPARSE_VLLM``, see the module docstring)."""

    cases: tuple[str, ...] = ("tiny", "smollm2")
    tiny_context: int = TINY_CONTEXT
    tiny_prompts: int = 8
    smollm2_contexts: tuple[int, ...] | None = None  # None: 4,300 and 7,500 (--quick: 4,300)
    smollm2_prompts: int = 8
    tiny_budget: int = 2048
    smollm2_budget: int = 1024
    methods: tuple[str, ...] | None = None
    options: tuple[tuple[str, Any], ...] = ()
    rounds: int = 1  # > 1: that many runs of each method, each between two dense runs

    def __post_init__(self) -> None:
        bad = sorted(set(self.cases) - {"tiny", "smollm2"})
        if bad:
            raise ValueError(f"KVFABRIC_BENCH_SPARSE_VLLM cases {bad}: expected tiny, smollm2")
        for key in (
            "tiny_context",
            "tiny_prompts",
            "smollm2_prompts",
            "tiny_budget",
            "smollm2_budget",
            "rounds",
        ):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"KVFABRIC_BENCH_SPARSE_VLLM {key}={v!r}: expected an integer >= 1")

    @classmethod
    def from_env(cls) -> RunConfig:
        raw = os.environ.get("KVFABRIC_BENCH_SPARSE_VLLM", "").strip()
        if not raw:
            return cls()
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("KVFABRIC_BENCH_SPARSE_VLLM must be a JSON object")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"KVFABRIC_BENCH_SPARSE_VLLM: unknown keys {unknown}; known: {sorted(known)}")
        for key in ("cases", "smollm2_contexts", "methods"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        if "options" in data:
            data["options"] = tuple(sorted(dict(data["options"]).items()))
        return cls(**data)


#: sparse options every sparse engine of this run gets besides the method and budget
_EXTRA_OPTIONS: dict[str, Any] = {}


class _Sparse:
    """``KVFABRIC_SPARSE`` set for the engines built inside (None: the stock backend)."""

    def __init__(self, method: str | None, budget: int, stats: Path) -> None:
        self.cfg = (
            None
            if method is None
            else {**_EXTRA_OPTIONS, "algorithm": method, "budget_tokens": budget, "stats_path": str(stats)}
        )
        self.prev: str | None = None

    def __enter__(self) -> _Sparse:
        self.prev = os.environ.pop("KVFABRIC_SPARSE", None)
        if self.cfg is not None:
            os.environ["KVFABRIC_SPARSE"] = json.dumps(self.cfg)
        return self

    def __exit__(self, *exc: object) -> None:
        os.environ.pop("KVFABRIC_SPARSE", None)
        if self.prev is not None:
            os.environ["KVFABRIC_SPARSE"] = self.prev


def _engine(model: Path, kv_bytes: int, max_len: int) -> Any:
    from kvfabric.harness.engine import make_engine

    return make_engine(model, None, kv_bytes=kv_bytes, max_model_len=max_len)


def _read_stats(path: Path, settle_s: float = 0.6, timeout_s: float = 10.0) -> dict[str, Any]:
    """The backend's stats file once it stopped changing for ``settle_s`` (its thread
    writes it within about 0.25 s of the last step; ``{}``: no file)."""

    def read() -> dict[str, Any]:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    last, deadline = read(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(settle_s)
        now = read()
        if now == last:
            return now
        last = now
    return last


@dataclass(frozen=True)
class Served:
    """One group of prompts served together: each one's answer, the seconds of the steps
    in which every request decoded (``batch_s``) and of those in which only the last,
    longer request was left (``solo_s``, batch 1), and the backend's counters over it."""

    answers: tuple[FirstDecode, ...]
    batch_s: tuple[float, ...]
    solo_s: tuple[float, ...]
    stats: dict[str, int]
    floor_s: tuple[float, ...] = ()  # the same engine's steps at a short context
    floor_solo_s: tuple[float, ...] = ()  # ... and at batch 1


def serve(eng: Any, prompts: Sequence[Sequence[int]], new: int, tail: int, stats: Path) -> Served:
    """Serve ``prompts`` at once through ``LLMEngine.step()`` (greedy; the last prompt
    ``tail`` tokens more than the others so that its last ``tail`` steps run alone), timing
    every step. Prompts are prefilled one per step while the earlier ones decode, so every
    request generates ``new + len(prompts)`` tokens (steps with all of them decoding
    exist); the answers keep the first ``new``."""
    from vllm import SamplingParams

    llm_engine = eng.llm.llm_engine

    def params(n: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=TOP_LOGPROBS)

    tag = time.monotonic_ns()
    rids = [f"sv{tag}-{i}" for i in range(len(prompts))]
    for i, (rid, p) in enumerate(zip(rids, prompts)):
        extra = len(prompts) + (tail if i == len(prompts) - 1 else 0)
        llm_engine.add_request(rid, {"prompt_token_ids": list(p)}, params(new + extra))
    before = _read_stats(stats)
    started: set[str] = set()
    finals: dict[str, Any] = {}
    batch_s: list[float] = []
    solo_s: list[float] = []
    while llm_engine.has_unfinished_requests():
        decoding, running = len(started) == len(prompts), len(prompts) - len(finals)
        t0 = time.perf_counter()
        outs = llm_engine.step()
        dt = time.perf_counter() - t0
        if decoding and len(outs) == running == len(prompts):
            batch_s.append(dt)
        elif decoding and len(outs) == running == 1:
            solo_s.append(dt)
        for o in outs:
            if o.outputs and o.outputs[0].token_ids:
                started.add(o.request_id)
            if o.finished:
                finals[o.request_id] = o
    answers = []
    for rid in rids:
        out = finals[rid].outputs[0]
        lp = out.logprobs[1] if out.logprobs and len(out.logprobs) > 1 else {}
        logprobs = {int(t): float(v.logprob) for t, v in lp.items()}
        answers.append(FirstDecode(tuple(out.token_ids[:new]), logprobs))
    return Served(tuple(answers), tuple(batch_s), tuple(solo_s), _delta(before, _read_stats(stats)))


def _model_path(name: str, context: int) -> Path:
    from kvfabric.harness import models

    if name == "smollm2":
        return models.smollm2()
    return models.tiny_llama(0, max_positions=max(8192, 1 << (context + 1024).bit_length()))


@dataclass(frozen=True)
class KVGeometry:
    """What one KV block costs to read: ``block_bytes`` (K and V of one block, one KV head,
    one layer, float32) for each of ``layers * kv_heads``."""

    layers: int
    kv_heads: int
    block_bytes: int

    @classmethod
    def of(cls, model: Path) -> KVGeometry:
        cfg = json.loads((model / "config.json").read_text())
        head = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        return cls(int(cfg["num_hidden_layers"]), int(cfg["num_key_value_heads"]), BLOCK * head * 2 * 4)

    def token_bytes(self) -> int:
        return self.layers * self.kv_heads * self.block_bytes // BLOCK


def kv_read(stats_delta: dict[str, int], geo: KVGeometry, batch: int) -> dict[str, Any]:
    """Compute saved from the backend's counters over one timed generation: the blocks the
    sparse (request, layer) decode steps read against what dense reads there
    (``kv_read_frac``), and per decode step of the batch in bytes (a (request, layer) step
    the switch left dense reads all its blocks)."""
    sel, tot = stats_delta.get("blocks_selected", 0), stats_delta.get("blocks_total", 0)
    sp, dn = stats_delta.get("sparse_layer_steps", 0), stats_delta.get("dense_layer_steps", 0)
    if sp <= 0 or tot <= 0:
        return {
            "kv_read_frac": 1.0,
            "sparse_layer_share": 0.0,
            "kv_bytes_per_step": None,
            "dense_kv_bytes_per_step": None,
        }
    per_step = geo.layers * batch * geo.kv_heads * geo.block_bytes
    share = sp / (sp + dn)
    dense_bytes = per_step * tot / sp
    return {
        "kv_read_frac": round(sel / tot, 4),
        "sparse_layer_share": round(share, 4),
        "kv_bytes_per_step": int(per_step * (share * sel / sp + (1 - share) * tot / sp)),
        "dense_kv_bytes_per_step": int(dense_bytes),
    }


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    keys = ("blocks_selected", "blocks_total", "sparse_layer_steps", "dense_layer_steps", "prompt_chunks")
    out = {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in keys}
    if after.get("reuse_steps") is not None:
        out["reuse_steps"] = int(after["reuse_steps"])
    return out


def _row(
    case: str, model: str, context: int, budget: int, batch: int, method: str, **fields: Any
) -> dict[str, Any]:
    base: dict[str, Any] = {
        "case": case,
        "engine": "vllm",
        "model": model,
        "context": context,
        "budget": budget,
        "batch": batch,
        "method": method,
        "default": method == "gsa" and not _EXTRA_OPTIONS,
        "options": dict(_EXTRA_OPTIONS) or None,
        "step_ms": None,
        "dense_step_ms": None,
        "speedup_vs_dense": None,
        "answers_match_dense": None,
        "passkeys_lost": None,
        "kl_mean": None,
        "kl_max": None,
    }
    return {**base, **fields}


@dataclass(frozen=True)
class Group:
    """Prompts served together on one model (``answers``: their passkeys, or None)."""

    model: str
    context: int
    budget: int
    prompts: tuple[tuple[int, ...], ...]
    answers: tuple[str, ...] | None


def _serve_all(groups: Sequence[Group], method: str | None, new: int, tail: int, work: Path) -> list[Served]:
    """Every group of one model through one engine (``method`` None: the stock backend)."""
    model = _model_path(groups[0].model, max(g.context for g in groups))
    geo = KVGeometry.of(model)
    longest = max(len(p) for g in groups for p in g.prompts)
    max_len = longest + new + tail + 64
    batch = max(len(g.prompts) for g in groups)
    kv = max(256 << 20, int(batch * (max_len + 2 * BLOCK) * geo.token_bytes() * 1.1))
    stats = work / f"{groups[0].model}-{method or 'dense'}.json"
    with _Sparse(method, groups[0].budget, stats):
        eng = _engine(model, kv, max_len)
        try:
            # first calls of each batch shape (untimed), then the same short group again: its
            # steps (256 tokens) give the engine's step time without long attention, the
            # floor any attention speed-up works against
            warm = [[1 + i % 100 for i in range(256)]] * batch
            serve(eng, warm, 4, 2, stats)
            floor = serve(eng, warm, 4, 4, stats)
            _say(f"  short-context steps (ms): batch {[round(t * 1e3, 1) for t in floor.batch_s]}")
            out = []
            for g in groups:
                _say(f"{g.model} ~{g.context} tokens x {len(g.prompts)}: {method or 'dense'}")
                sv = serve(eng, g.prompts, new, tail, stats)
                out.append(dataclasses.replace(sv, floor_s=floor.batch_s, floor_solo_s=floor.solo_s))
                _say(
                    f"  steps (ms): batch {[round(t * 1e3, 1) for t in sv.batch_s]}, "
                    f"solo {[round(t * 1e3, 1) for t in sv.solo_s]}; {sv.stats}"
                )
            return out
        finally:
            eng.close()


def _ms(times: Sequence[float]) -> float:
    if not times:
        raise RuntimeError("no decode step was timed (too few new tokens?)")
    return statistics.median(times) * 1e3


#: the stock backend's name in a flanked schedule (:func:`run_order` gives it as None)
_STOCK = "<stock backend>"


def run_order(methods: Sequence[str], rounds: int) -> list[str | None]:
    """The engines of one model in the order they run (None: dense): dense, then every
    method; with ``rounds`` > 1, each method's run ``rounds`` times in a flanked schedule
    (:func:`kvfabric.bench.flank.flanked_schedule`), each run between two dense runs."""
    if rounds <= 1:
        return [None, *methods]
    return [None if m == _STOCK else m for m in flanked_schedule(list(methods) * rounds, _STOCK)]


def flanked(
    order: Sequence[str | None], step_ms: Sequence[float | None]
) -> dict[str, list[tuple[float, float]]]:
    """Per method, ``(its step, the dense step next to it)`` for each of its timed runs in
    ``order`` (``step_ms`` per run, None: not timed): the geometric mean of the nearest
    timed dense runs before and after it (:func:`kvfabric.bench.flank.adjacent_means`;
    with one round, the first dense run alone), which shields each ratio from the
    machine's drift between runs."""
    near = adjacent_means([m is None for m in order], step_ms)
    out: dict[str, list[tuple[float, float]]] = {}
    for m, st, dn in zip(order, step_ms, near):
        if m is not None and st is not None and dn is not None:
            out.setdefault(m, []).append((st, dn))
    return out


def group_rows(
    groups: Sequence[Group],
    methods: Sequence[str],
    new: int,
    tail: int,
    work: Path,
    tok: Any = None,
    rounds: int = 1,
) -> Iterator[dict[str, Any]]:
    """Dense and every method on ``groups`` (one model, in :func:`run_order`); per method
    and group a speed row at the group's batch and at batch 1, and an accuracy row when it
    has answers (a method's first run against the first dense run: greedy decoding gives
    every run the same tokens)."""
    order = run_order(methods, rounds)
    runs = [_serve_all(groups, m, new, tail, work) for m in order]
    dense = runs[0]
    geo = KVGeometry.of(_model_path(groups[0].model, max(g.context for g in groups)))
    picks = {"batch": lambda sv: sv.batch_s, "solo": lambda sv: sv.solo_s}
    # per group and batch, once for every method: each run's median step and the flanking
    timed: dict[tuple[int, str], tuple[list[float | None], dict[str, list[tuple[float, float]]]]] = {}
    for gi in range(len(groups)):
        for kind, pick in picks.items():
            medians = [_ms(pick(r[gi])) if pick(r[gi]) else None for r in runs]
            timed[gi, kind] = (medians, flanked(order, medians))
    for method in methods:
        mine = [j for j, m in enumerate(order) if m == method]
        served = runs[mine[0]]
        for gi, (g, d, m) in enumerate(zip(groups, dense, served)):
            ctx = round(statistics.mean(len(p) for p in g.prompts))
            for batch, kind, fl in ((len(g.prompts), "batch", d.floor_s), (1, "solo", d.floor_solo_s)):
                ms, dms = picks[kind](m), picks[kind](d)
                if not ms or not dms:
                    _say(f"  no step of batch {batch} was timed: no speed row")
                    continue
                medians, by_method = timed[gi, kind]
                pairs = by_method.get(method, [])
                if not pairs:
                    continue
                ratios = [dn / st for st, dn in pairs]
                speedup = statistics.median(ratios)
                step = statistics.median(st for st, _ in pairs)
                dstep = statistics.median(dn for _, dn in pairs)
                floor = round(_ms(fl), 3) if fl else None
                yield _row(
                    "speed",
                    g.model,
                    ctx,
                    g.budget,
                    batch,
                    method,
                    step_ms=round(step, 3),
                    dense_step_ms=round(dstep, 3),
                    speedup_vs_dense=round(speedup, 3),
                    rounds=len(pairs),
                    speedup_vs_dense_runs=[round(x, 3) for x in ratios] if len(pairs) > 1 else None,
                    dense_step_ms_runs=(
                        [round(x, 3) for x, o in zip(medians, order) if o is None and x is not None]
                        if len(pairs) > 1
                        else None
                    ),
                    step_ms_mean=round(statistics.mean(ms) * 1e3, 3),
                    dense_step_ms_mean=round(statistics.mean(dms) * 1e3, 3),
                    dense_short_step_ms=floor,
                    reuse_steps=m.stats.get("reuse_steps"),
                    prompt_chunks=m.stats.get("prompt_chunks"),
                    steps=len(ms),
                    **kv_read(m.stats, geo, batch),
                    kv_memory_saved_bytes=0,
                    machine=machine_note(),
                )
            if g.answers is None:
                continue
            acc = accuracy(
                g.answers,
                d.answers,
                [tok.decode(list(x.tokens)) for x in d.answers],
                m.answers,
                [tok.decode(list(x.tokens)) for x in m.answers],
            )
            yield _row(
                "accuracy",
                g.model,
                ctx,
                g.budget,
                len(g.prompts),
                method,
                answers_match_dense=round(acc.answers_match_dense, 4),
                passkeys_lost=acc.passkeys_lost,
                kl_mean=round(acc.kl_mean, 6),
                kl_max=round(acc.kl_max, 6),
                prompts=acc.prompts,
                dense_found=acc.dense_found,
                found=acc.found,
                kl_outside_mass_max=round(acc.kl_outside_mass_max, 6),
                kl_top_logprobs=TOP_LOGPROBS,
            )


def run(ctx: BenchContext) -> Iterator[dict[str, Any]]:
    """The tiny Llama's long context, then SmolLM2's passkey groups (module docstring)."""
    import random

    from kvfabric.harness.engine import vllm_problem
    from kvfabric.harness.sparse.model import Tokenizer

    problem = vllm_problem()
    if problem:
        raise RuntimeError(problem)
    rc = RunConfig.from_env()
    methods = tuple(ctx.options.get("methods") or rc.methods or METHODS)
    _EXTRA_OPTIONS.clear()
    _EXTRA_OPTIONS.update(dict(rc.options))
    tok = Tokenizer()
    contexts = rc.smollm2_contexts or (SMOLLM2_CONTEXTS[:1] if ctx.quick else SMOLLM2_CONTEXTS)
    groups = []
    if "smollm2" in rc.cases:
        for i, n in enumerate(contexts):
            # the full run's groups keep their seeds when run alone (4,300: 0, 7,500: 100)
            offset = 100 * SMOLLM2_CONTEXTS.index(n) if n in SMOLLM2_CONTEXTS else 100 * i
            pks = [build_prompt(tok, s) for s in prompt_specs(n, rc.smollm2_prompts, offset=offset)]
            groups.append(
                Group(
                    "smollm2",
                    n,
                    rc.smollm2_budget,
                    tuple(tuple(p.ids) for p in pks),
                    tuple(p.answer for p in pks),
                )
            )
    rng = random.Random(0)
    n = rc.tiny_context
    tiny = tuple(tuple(rng.randrange(1, 512) for _ in range(n)) for _ in range(rc.tiny_prompts))
    with tempfile.TemporaryDirectory(prefix="kvf-sparse-vllm-") as work:
        if "tiny" in rc.cases:
            yield from group_rows(
                [Group("tiny-llama", n, rc.tiny_budget, tiny, None)],
                methods,
                12,
                12,
                Path(work),
                rounds=rc.rounds,
            )
        if groups:
            yield from group_rows(groups, methods, NEW_TOKENS, 12, Path(work), tok, rounds=rc.rounds)


if __name__ == "__main__":
    for r in run(BenchContext(quick="--quick" in sys.argv)):
        print(json.dumps(r))
