"""The store registry: names to classes (imported lazily), pipelines by spec, one config.

A spec is a store name (``"posix"``) or a pipeline of a caching tier above one store
(``"cache|posix"``). ``create(spec, config, platform=..., layout=...)`` builds it from
one flat mapping: ``"store"`` (the spec, when ``spec`` is not given) and
``"<store>.<key>"`` entries that each store validates; ``"pipeline.<key>"`` configures
the pipeline. Keys for stores that are not part of the spec, and keys of no store at
all, are errors that name the key, so a typo never goes unnoticed.

Indexes: ``create_index(spec, config, layout=...)`` builds the read-only metadata side
(``base.Index``, ``index.py``) of what a pipeline shares across processes, its lowest tier,
for a scheduler that only counts hits; ``unshared_reason`` says why a spec cannot be seen
from another process (a ``cache`` alone, an embedded pool).

Adding a store: an entry in ``STORES`` here (a :class:`kvfabric.registry.Registry`), an
installed plugin (the ``kvfabric.stores`` entry-point group; its index, if any, in
``kvfabric.store_indexes``), or :func:`register` from outside. Its configuration is a
``store.config.StoreConfig`` (the one configuration language, ``kvfabric.settings``). Its class
implements the contract (``base.py``), takes ``(config_mapping, platform=, layout=)``
through ``from_config`` and returns :class:`~kvfabric.ucm_layer.store.task.StoreTask`
tasks (pipelines cancel them).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from kvfabric.platform.base import Platform
from kvfabric.registry import Registry
from kvfabric.ucm_layer.store.base import Index, Store, StoreLayout

STORES: Registry[type[Store]] = Registry(
    "store",
    {
        "posix": "kvfabric.ucm_layer.store.posix:PosixStore",
        "cache": "kvfabric.ucm_layer.store.cache:CacheStore",
        "pool": "kvfabric.ucm_layer.store.pool:PoolStore",
    },
)
#: stores that may sit above another one in a pipeline
CACHING_TIERS: set[str] = {"cache"}
#: indexes (``index.py``) of the stores another process can look into
INDEXES: Registry[Any] = Registry(
    "store index",
    {
        "posix": "kvfabric.ucm_layer.store.index:PosixIndex",
        "pool": "kvfabric.ucm_layer.store.index:PoolIndex",
    },
    group="kvfabric.store_indexes",
)
#: stores whose blocks live in one process's memory (no index from another process)
PROCESS_LOCAL: set[str] = {"cache"}
PIPELINE_PREFIX = "pipeline"
SPEC_KEY = "store"

_lock = threading.Lock()


def register(
    name: str, target: str, caching: bool = False, index: str | None = None, process_local: bool = False
) -> None:
    """Register store ``name`` as ``"package.module:Class"`` (imported when first built);
    ``index``: the ``"package.module:Class"`` of its index (``create_index``; without one an
    index of it is the whole store); ``process_local``: its blocks live in one process."""
    if not name or not name.isidentifier() or name == PIPELINE_PREFIX:
        raise ValueError(f"store name must be an identifier other than {PIPELINE_PREFIX!r}, got {name!r}")
    if ":" not in target:
        raise ValueError(f"store target must be 'package.module:Class', got {target!r}")
    with _lock:
        STORES.register(name, target, replace=True)
        if caching:
            CACHING_TIERS.add(name)
        if index is not None:
            INDEXES.register(name, index, replace=True)
        if process_local:
            PROCESS_LOCAL.add(name)


def available() -> list[str]:
    return STORES.names()


def store_class(name: str) -> type[Store]:
    """The class registered as ``name`` (imports its module now)."""
    cls = STORES.load(name)
    if not (isinstance(cls, type) and issubclass(cls, Store)):
        raise ImportError(f"{STORES.target(name)!r} (store {name!r}) is not a Store class")
    return cls


def parse_spec(spec: str) -> tuple[str, ...]:
    """``"cache|posix"`` -> ``("cache", "posix")``, checked against the registry."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"store spec must be a name like 'posix' or 'cache|posix', got {spec!r}")
    tiers = tuple(t.strip() for t in spec.split("|"))
    known = STORES.targets()
    for t in tiers:
        if t not in known:
            raise ValueError(f"unknown store {t!r} in {spec!r}; known: {', '.join(available())}")
    if len(set(tiers)) != len(tiers):
        raise ValueError(f"store spec {spec!r} names a store twice")
    if len(tiers) > 2:
        raise ValueError(f"store spec {spec!r}: a pipeline is one caching tier above one store")
    if len(tiers) == 2 and tiers[0] not in CACHING_TIERS:
        raise ValueError(
            f"store spec {spec!r}: only a caching tier ({', '.join(sorted(CACHING_TIERS))}) may sit "
            "above another store"
        )
    return tiers


def check_keys(spec: str, tiers: tuple[str, ...], config: Mapping[str, Any]) -> None:
    """Every key belongs to a tier of ``spec`` (or the pipeline, or is ``"store"``)."""
    owners = set(tiers) | ({PIPELINE_PREFIX} if len(tiers) > 1 else set())
    names = ", ".join(sorted(owners))
    for key in config:
        if key == SPEC_KEY:
            continue
        if not isinstance(key, str) or "." not in key:
            raise ValueError(f"config key {key!r} is not '<store>.<name>' (stores of {spec!r}: {names})")
        prefix = key.split(".", 1)[0]
        if prefix in owners:
            continue
        if prefix in STORES or prefix == PIPELINE_PREFIX:
            raise ValueError(
                f"config key {key!r} is for {prefix!r}, which is not part of store spec {spec!r}"
            )
        raise ValueError(f"unknown config key {key!r}: no store {prefix!r} (stores of {spec!r}: {names})")


def checked_spec(spec: str | None, config: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    """The spec (``spec``, else ``config["store"]``; the two must agree) and its tiers, with
    every key of ``config`` checked to belong to one of them (:func:`check_keys`)."""
    if spec is None:
        spec = config.get(SPEC_KEY)
        if spec is None:
            raise ValueError(f"no store spec: pass spec= or set config key {SPEC_KEY!r} (e.g. 'cache|posix')")
    elif SPEC_KEY in config and config[SPEC_KEY] != spec:
        raise ValueError(f"store spec {spec!r} disagrees with config key {SPEC_KEY}={config[SPEC_KEY]!r}")
    tiers = parse_spec(spec)
    check_keys(spec, tiers, config)
    return spec, tiers


def create(
    spec: str | None = None,
    config: Mapping[str, Any] | None = None,
    *,
    layout: StoreLayout,
    platform: Platform | None = None,
) -> Store:
    """Build the store or pipeline ``spec`` (default: ``config["store"]``) from ``config``.

    ``platform`` defaults to the process-wide one; every tier shares it. The caller owns
    the returned store and closes it (a pipeline closes its tiers)."""
    cfg = dict(config or {})
    spec, tiers = checked_spec(spec, cfg)
    if platform is None:
        from kvfabric.platform.registry import default

        platform = default()
    pipeline_config = None
    if len(tiers) > 1:
        from kvfabric.ucm_layer.store.pipeline import PipelineConfig

        pipeline_config = PipelineConfig.from_mapping(cfg)  # checked before anything is built
    built: list[Store] = []
    try:
        for name in tiers:
            built.append(store_class(name).from_config(cfg, platform=platform, layout=layout))
        if pipeline_config is None:
            return built[0]
        from kvfabric.ucm_layer.store.pipeline import Pipeline

        return Pipeline(pipeline_config, built[0], built[1])
    except BaseException:
        for s in reversed(built):
            s.close()
        raise


def unshared_reason(spec: str, config: Mapping[str, Any] | None = None) -> str | None:
    """Why the pipeline ``spec`` with ``config`` keeps its blocks in one process (so a
    scheduler in another process could never see them), or None when it is shared."""
    tiers = parse_spec(spec)
    lowest = tiers[-1]
    if lowest in PROCESS_LOCAL:
        return f"store {spec!r} keeps its blocks in the memory of one process (the {lowest!r} store)"
    return INDEXES.load(lowest).unshared(dict(config or {})) if lowest in INDEXES else None


def create_index(
    spec: str | None = None,
    config: Mapping[str, Any] | None = None,
    *,
    layout: StoreLayout,
    platform: Platform | None = None,
) -> Index:
    """The index (``base.Index``, ``index.py``) of the store or pipeline ``spec``: of its
    lowest tier, where a block is visible only once stored. ``layout`` gives the shard
    count a block must have complete. ``UnsharedStore`` when the blocks live in one
    process (:func:`unshared_reason`); a store with no registered index is built whole (its
    lookups then cost what the store costs). The caller closes the index."""
    from kvfabric.ucm_layer.store.index import UnsharedStore

    cfg = dict(config or {})
    spec, tiers = checked_spec(spec, cfg)
    why = unshared_reason(spec, cfg)
    if why:
        raise UnsharedStore(why)
    lowest = tiers[-1]
    mine = {k: v for k, v in cfg.items() if k.split(".", 1)[0] == lowest}
    if platform is None:
        from kvfabric.platform.registry import default

        platform = default()
    if lowest not in INDEXES:
        return create(lowest, mine, layout=layout, platform=platform)
    return INDEXES.load(lowest).from_config(mine, platform=platform, layout=layout)
