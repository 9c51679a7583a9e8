"""The demo and the tests take their engine, model and peer helpers from
``kvfabric.harness``, never from the benchmarks (``kvfabric.bench``): only the CLI's
``bench`` command and the tests whose subject is a benchmark import ``kvfabric.bench``."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: tests whose subject is a benchmark (its plumbing, its metrics, its registry)
BENCH_TESTS = {"test_bench_pool.py", "test_bench_rpc.py", "test_bench_xcopy.py", "test_sparse_harness.py"}
BENCH_TESTS |= {"test_registry_axes.py", "test_bench_compare.py", "test_bench_sparse_vllm.py"}
BENCH_TESTS |= {"test_bench_serve.py", "test_bench_cluster.py", "test_cluster_kill.py"}
#: ``kvfabric sim validate`` checks the simulator against what the benchmarks measure: it
#: serves ``bench serve``'s own workload with its serving loop (imported inside the functions)
VALIDATORS = {"simulate/validate.py"}


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_only_benchmarks_and_their_tests_import_bench():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        skipped = rel.parts[0] in ("bench", ".git", "build") or rel.name in BENCH_TESTS
        if skipped or str(rel) in {"cli.py", *VALIDATORS}:
            continue
        if any(m == "kvfabric.bench" or m.startswith("kvfabric.bench.") for m in _imports(path)):
            offenders.append(str(rel))
    assert offenders == []


def test_the_demo_loads_no_benchmark_module():
    code = (
        "import sys, json, kvfabric.demo, kvfabric.demo_vllm\n"
        "import kvfabric.harness.engine, kvfabric.harness.models\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('kvfabric.bench'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []
