"""The package's import graph: no import circles, and a pool client without service code.

Every module of ``kvfabric`` is parsed with ``ast`` (nothing is imported); an edge is a
top-level ``import`` / ``from ... import`` of another ``kvfabric`` module. Imports inside
functions are left out (they run later, when the circle is already closed), and so are
``if TYPE_CHECKING:`` blocks, except in the stricter check of ``kvfabric.pool``, whose
modules must not refer back to each other even for annotations. ``from pkg import name``
is an edge to ``pkg.name`` when that is a module, else to ``pkg``.

Layers, for the messages: a module belongs to the package that holds it, cut at two
levels below ``kvfabric`` (``kvfabric.pool.client``, ``kvfabric.pool.service``,
``kvfabric.pool.gva`` with its rendezvous and transports, ``kvfabric.ucm_layer.store``,
``kvfabric.platform``, ``kvfabric.pool`` for the pool's shared vocabulary, ``kvfabric``
for top-level modules). The check is stricter than "no circle inside a layer": the whole
graph must be acyclic, and a circle is reported with its path and the layers it crosses.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvfabric

ROOT = Path(kvfabric.__file__).resolve().parent
SKIP_DIRS = {"tests", "venv", ".venv", "build", "__pycache__"}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.startswith(".") for part in rel.parts[:-1]):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(["kvfabric", *parts])] = path
    return mods


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def _top_level(body: list[ast.stmt], type_checking: bool) -> list[ast.stmt]:
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            if _is_type_checking(node.test) and not type_checking:
                continue
            out += _top_level(node.body + node.orelse, type_checking)
        elif isinstance(node, ast.Try):
            handlers = [s for h in node.handlers for s in h.body]
            out += _top_level(node.body + handlers + node.orelse + node.finalbody, type_checking)
        else:
            out.append(node)
    return out


def imports_of(name: str, type_checking: bool = False) -> set[str]:
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _top_level(ast.parse(path.read_text()).body, type_checking):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            subs = {f"{src}.{a.name}" for a in node.names} & MODULES.keys()
            found |= subs or {src}
            if len(subs) < len(node.names):
                found.add(src)
    return {m for m in found if m in MODULES and m != name}


def graph(type_checking: bool = False, within: str = "kvfabric") -> dict[str, set[str]]:
    def inside(m: str) -> bool:
        return m == within or m.startswith(within + ".")

    return {m: {d for d in imports_of(m, type_checking) if inside(d)} for m in sorted(MODULES) if inside(m)}


def layer(module: str) -> str:
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    return ".".join(package.split(".")[:3])


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """One circle (as a path that returns to its start) per strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the package is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                on.discard(w)
                scc.add(w)
                if w == v:
                    break
            if len(scc) > 1 or v in g[v]:
                found.append(_path(g, scc))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def _path(g: dict[str, set[str]], scc: set[str]) -> list[str]:
    """A shortest circle through the component's first module (breadth-first)."""
    start = min(scc)
    prev: dict[str, str] = {}
    queue, seen = [start], {start}
    while queue:
        v = queue.pop(0)
        for w in sorted(g[v] & scc):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [*reversed(path), start]
            if w not in seen:
                seen.add(w)
                prev[w] = v
                queue.append(w)
    return sorted(scc)


def _describe(found: list[list[str]]) -> str:
    return "\n".join(
        " -> ".join(path) + f"   (layers: {', '.join(sorted({layer(m) for m in path}))})" for path in found
    )


def closure(start: str, g: dict[str, set[str]]) -> set[str]:
    """What importing ``start`` loads: its imports, theirs, and every parent package."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parents = [".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)]
        todo += [d for d in [*g[m], *parents] if d in g]
    return seen


def test_the_parser_sees_the_layers():
    g = graph()
    assert "kvfabric.pool.client.session" in g["kvfabric.pool.client.api"]
    assert "kvfabric.pool.service.dispatch" in g["kvfabric.pool.service.local"]
    assert "kvfabric.pool.gva.fabric" not in g["kvfabric.pool.gva.monitor"]
    assert layer("kvfabric.pool.gva.rendezvous.server") == "kvfabric.pool.gva"
    assert layer("kvfabric.pool.client") == "kvfabric.pool.client"
    assert layer("kvfabric.pool.protocol") == "kvfabric.pool"
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_circle_anywhere_in_the_package():
    found = cycles(graph())
    assert not found, "import circles:\n" + _describe(found)


def test_no_circle_inside_pool_even_for_annotations():
    """pool/: no module refers back to one that imports it, not even under TYPE_CHECKING
    (a reader or writer that names its client, a monitor that names its fabric)."""
    found = cycles(graph(type_checking=True, within="kvfabric.pool"))
    assert not found, "import circles in pool/ (TYPE_CHECKING included):\n" + _describe(found)


def test_the_client_imports_no_service_module():
    loaded = closure("kvfabric.pool.client", graph())
    service = sorted(m for m in loaded if m.startswith("kvfabric.pool.service"))
    assert not service, f"importing kvfabric.pool.client loads service modules: {service}"
    assert "kvfabric.pool.client.api" in loaded and "kvfabric.pool.gva.fabric" in loaded


def test_the_client_imports_no_service_module_for_real():
    code = (
        "import kvfabric.pool.client, sys; "
        "print(sorted(m for m in sys.modules if m.startswith('kvfabric.pool.service')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
