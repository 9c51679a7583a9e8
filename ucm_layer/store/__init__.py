"""kvfabric.ucm_layer.store: the async store contract (``base.py``), the stores and pipelines.

``create(spec, config, layout=..., platform=...)`` builds a store or pipeline by name
(``"posix"``, ``"cache"``, ``"cache|posix"``); store modules are imported only when built.
See docs/stores.md.
"""

from kvfabric.ucm_layer.store.base import BlockStatus, Store, StoreLayout, Task, TaskKind
from kvfabric.ucm_layer.store.registry import available, create, register

__all__ = ["BlockStatus", "Store", "StoreLayout", "Task", "TaskKind", "available", "create", "register"]
