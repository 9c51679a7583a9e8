"""The one registry type every axis uses (``kvfabric.registry.Registry``)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from kvfabric.registry import Registry


class Base:
    pass


def test_unknown_names_list_the_known_ones_and_builtins_stay():
    r: Registry = Registry("widget", {"a": "kvfabric.errors:KVFabricError", "b": "kvfabric.errors"})
    with pytest.raises(ValueError, match=r"unknown widget 'zz'; known: a, b"):
        r.load("zz")
    assert r.load("b").__name__ == "kvfabric.errors"  # a module target
    with pytest.raises(ValueError, match="built in"):
        r.register("a", "x:Y")
    r.register("c", "kvfabric.errors:KeyNotFound")
    with pytest.raises(ValueError, match="already registered"):
        r.register("c", "kvfabric.errors:OutOfSpace")
    r.register("c", "kvfabric.errors:OutOfSpace", replace=True)
    assert r.target("c") == "kvfabric.errors:OutOfSpace" and "c" in r and r.names() == ["a", "b", "c"]
    r.unregister("c")
    assert "c" not in r
    for bad in ("", ":X", "mod:"):
        with pytest.raises(ValueError, match="target must be"):
            r.register("d", bad)


def test_kind_and_import_errors_name_the_entry():
    r: Registry = Registry(
        "gadget",
        {"wrong": "kvfabric.errors:KVFabricError", "gone": "kvfabric.nowhere:X", "ok": f"{__name__}:Base"},
        kind=Base,
        hint=lambda name: f"pip install 'kvfabric[{name}]'",
    )
    with pytest.raises(TypeError, match="is not a Base"):
        r.load("wrong")
    with pytest.raises(ImportError, match=r"gadget 'gone' needs 'kvfabric.nowhere'.*kvfabric\[gone\]"):
        r.load("gone")
    assert isinstance(r.create("ok"), Base)


def test_plugins_come_from_the_axis_entry_point_group(tmp_path, monkeypatch):
    (tmp_path / "kvf_axis_plugin.py").write_text("class Thing:\n    pass\n")
    dist = tmp_path / "kvf_axis_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvf-axis-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kvfabric.things]\nthing = kvf_axis_plugin:Thing\na = x:Y\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    r: Registry = Registry("thing", {"a": "kvfabric.errors:KVFabricError"})
    assert r.group == "kvfabric.things"
    assert r.target("thing") == "kvf_axis_plugin:Thing"
    assert r.target("a") == "kvfabric.errors:KVFabricError"  # a plugin never replaces a built-in
    assert r.load("thing").__name__ == "Thing"
    sys.modules.pop("kvf_axis_plugin", None)


def test_built_in_and_registered_names_load_without_reading_the_installed_plugins(monkeypatch):
    # the sparse scorers are loaded per request and layer: a metadata scan each time cost
    # ~15 ms a load in a vLLM worker; only a name that is neither built in nor registered
    # reads the entry points (so a plugin installed later is still found)
    reads: list[str] = []
    real = importlib.metadata.entry_points

    def counted(**kw):
        reads.append(kw.get("group", ""))
        return real(**kw)

    monkeypatch.setattr(importlib.metadata, "entry_points", counted)
    r: Registry = Registry("widget", {"a": "kvfabric.errors:KVFabricError"})
    r.register("c", "kvfabric.errors:KeyNotFound")
    for _ in range(3):
        assert r.load("a").__name__ == "KVFabricError" and r.load("c").__name__ == "KeyNotFound"
    assert reads == []
    with pytest.raises(ValueError, match="unknown widget"):
        r.load("zz")
    assert reads and all(g == r.group for g in reads)


def test_every_axis_is_a_registry_and_imports_nothing_until_used():
    code = (
        "import sys\n"
        "from kvfabric.registry import Registry\n"
        "from kvfabric.platform.registry import PLATFORMS\n"
        "from kvfabric.ucm_layer.store.registry import STORES, INDEXES\n"
        "from kvfabric.ucm_layer.sparse.base import ALGORITHMS\n"
        "from kvfabric.ucm_layer.sparse.scorer import SCORERS\n"
        "from kvfabric.pool.gva.transports import TRANSPORTS\n"
        "from kvfabric.pool.gva.transports.remote import ENGINES\n"
        "from kvfabric.pool.gva.rendezvous import STORES as RDV\n"
        "from kvfabric.bench import BENCHMARKS\n"
        "from kvfabric.bench.stores import STORES as PEERS\n"
        "axes = [PLATFORMS, STORES, INDEXES, ALGORITHMS, SCORERS, TRANSPORTS, ENGINES, RDV]\n"
        "axes += [BENCHMARKS, PEERS]\n"
        "assert all(isinstance(a, Registry) for a in axes)\n"
        "targets = [t.partition(':')[0] for a in axes for t in a.targets().values()]\n"
        "import json; print(json.dumps(sorted(set(m for m in targets if m in sys.modules))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out)
    # modules an axis's own package imports anyway are fine; no backend, store, algorithm,
    # transport engine or benchmark module is imported by naming it
    assert not [
        m for m in loaded if m.split(".")[-1] in ("cuda", "ascend", "posix", "mooncake", "etcd", "e2e")
    ], loaded
