"""kvfabric: a memory-semantic KV-cache pool stack for LLM inference.

Layers, bottom up: ``kvfabric.platform`` (one device contract: sim, cuda, ascend),
``kvfabric.pool`` (global virtual address space and object pool), ``kvfabric.ucm_layer``
(block ids, stores, the vLLM connector, sparse attention). Importing this package loads
no vendor SDK and no torch; each layer is imported on use.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
