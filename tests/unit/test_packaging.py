"""The package layout rules of DESIGN.md, checked against the tree on disk."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from kvf_testing import REPO

tomllib = pytest.importorskip("tomllib")

SKIP_DIRS = {"tests", "docs", "build", "dist", "venv", ".venv", ".git", ".ci", "__pycache__"}


def _package_dirs() -> set[str]:
    """Every directory under the root holding Python modules (plus the root itself)."""
    found = {"kvfabric"}
    for py in REPO.rglob("*.py"):
        rel = py.parent.relative_to(REPO)
        if rel.parts and (
            rel.parts[0] in SKIP_DIRS or rel.parts[0].startswith(".") or rel.parts[0].endswith(".egg-info")
        ):
            continue
        if rel.parts:
            found.add("kvfabric." + ".".join(rel.parts))
    return found


def test_packages_list_matches_directories_on_disk():
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert conf["package-dir"] == {"kvfabric": "."}
    assert set(conf["packages"]) == _package_dirs()
    assert (REPO / "py.typed").exists()


def test_platform_has_no_init_and_backends_do():
    assert not (REPO / "platform" / "__init__.py").exists()
    for backend in ("sim", "cuda", "ascend"):
        assert (REPO / "platform" / backend / "__init__.py").exists()


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def test_no_module_imports_our_layers_bare():
    bare = ("pool", "ucm_layer", "bench", "errors", "envs")
    offenders = []
    for py in REPO.rglob("*.py"):
        rel = py.relative_to(REPO)
        if rel.parts[0] in SKIP_DIRS - {"tests"} or rel.parts[0].startswith("."):
            continue
        for line, mod in _imports(py):
            top = mod.split(".")[0]
            if top in bare or (top == "platform" and "." in mod):
                offenders.append(f"{rel}:{line}: import {mod}")
    assert not offenders, "use absolute kvfabric.* imports:\n" + "\n".join(offenders)


def test_stdlib_platform_is_not_shadowed_from_the_root():
    out = subprocess.run(
        [sys.executable, "-c", "import platform; print(platform.system())"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() in ("Linux", "Darwin", "Windows")


def test_import_kvfabric_loads_no_vendor_sdk_and_no_torch():
    code = (
        "import sys, kvfabric, kvfabric.platform.registry, kvfabric.platform.cuda, "
        "kvfabric.platform.ascend, kvfabric.errors\n"
        "kvfabric.platform.registry.detect()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'torch_npu', 'cupy', 'vllm', 'vllm_ascend', 'mooncake', 'acl'))\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_layers_import_only_layers_below():
    order = {"platform": 0, "pool": 1, "ucm_layer": 2}
    offenders = []
    for layer, rank in order.items():
        for py in (REPO / layer).rglob("*.py"):
            for line, mod in _imports(py):
                parts = mod.split(".")
                if parts[0] == "kvfabric" and len(parts) > 1 and parts[1] in order and order[parts[1]] > rank:
                    offenders.append(f"{py.relative_to(REPO)}:{line}: {mod}")
    assert not offenders, "\n".join(offenders)
