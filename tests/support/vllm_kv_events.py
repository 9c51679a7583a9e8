"""vLLM's KV event schema for tests, without paying for ``import vllm`` (~25 s here).

``load()`` reads ``vllm/distributed/kv_events.py`` of the installed vLLM (found with
``importlib.util.find_spec("vllm")``, which imports nothing) and executes exactly its
schema: the class statements of ``EventBatch``, ``KVCacheEvent``, ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``, ``KVEventBatch`` and the ``MEDIUM_*`` constants,
with ``ExternalBlockHash`` as ``vllm/v1/core/kv_cache_utils.py`` defines it, and
``ZmqEventPublisher.END_SEQ``. The module's other statements (its imports of the rest of
vLLM, the publisher classes) are left out. With ``KVFABRIC_TEST_VLLM_IMPORT=1`` it imports
the real module instead. None when vLLM is not installed.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

import msgspec

SCHEMA = ("EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch")


def _source_dir() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _external_block_hash(root: Path) -> Any:
    tree = ast.parse((root / "v1" / "core" / "kv_cache_utils.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "ExternalBlockHash":
            return eval(compile(ast.Expression(node.value), "kv_cache_utils.py", "eval"), {})
    raise LookupError("vllm/v1/core/kv_cache_utils.py defines no ExternalBlockHash")


def load() -> types.SimpleNamespace | None:
    """vLLM's schema (``.KVEventBatch``, ``.BlockStored``, ..., ``.END_SEQ``,
    ``.source``: where it came from), or None without vLLM."""
    root = _source_dir()
    if root is None:
        return None
    if os.environ.get("KVFABRIC_TEST_VLLM_IMPORT") == "1":
        import vllm.distributed.kv_events as real

        ns = {name: getattr(real, name) for name in dir(real)}
        return types.SimpleNamespace(**ns, END_SEQ=real.ZmqEventPublisher.END_SEQ, source="import")
    path = root / "distributed" / "kv_events.py"
    tree = ast.parse(path.read_text())
    keep: list[ast.stmt] = []
    end_seq: ast.expr | None = None
    for node in tree.body:
        schema_class = isinstance(node, ast.ClassDef) and node.name in SCHEMA
        medium = isinstance(node, ast.Assign) and all(
            isinstance(t, ast.Name) and t.id.startswith("MEDIUM_") for t in node.targets
        )
        if schema_class or medium:
            keep.append(node)
        elif isinstance(node, ast.ClassDef) and node.name == "ZmqEventPublisher":
            for item in node.body:
                if isinstance(item, ast.Assign) and getattr(item.targets[0], "id", "") == "END_SEQ":
                    end_seq = item.value
    found = {n.name for n in keep if isinstance(n, ast.ClassDef)}
    if found != set(SCHEMA) or end_seq is None:
        raise LookupError(f"{path}: schema classes {sorted(set(SCHEMA) - found)} or END_SEQ not found")
    module = types.ModuleType("_vllm_kv_events_schema")  # msgspec resolves annotations through it
    sys.modules[module.__name__] = module
    ns = module.__dict__
    ns.update(msgspec=msgspec, Any=Any, ExternalBlockHash=_external_block_hash(root))
    # dont_inherit: the schema's annotations are evaluated as vLLM's module evaluates them
    exec(compile(ast.Module(keep, []), str(path), "exec", dont_inherit=True), ns)
    ns["END_SEQ"] = eval(compile(ast.Expression(end_seq), str(path), "eval"), {})
    return types.SimpleNamespace(**{k: v for k, v in ns.items() if not k.startswith("__")}, source=str(path))
