"""``close_runtimes``: an autouse fixture for test modules that build ``SparseRuntime``s.

Every runtime a test builds is closed after the test, while its stats file's directory
still exists: an unclosed one flushes the file at interpreter exit, into a temporary
directory that pytest has removed by then. Import it into a test module's namespace."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvfabric.ucm_layer.sparse.vllm.runtime import SparseRuntime


@pytest.fixture(autouse=True)
def close_runtimes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[SparseRuntime]]:
    """The runtimes built during the test (closed after it; ``close`` is idempotent)."""
    made: list[SparseRuntime] = []
    init = SparseRuntime.__init__

    def tracked(self: SparseRuntime, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(SparseRuntime, "__init__", tracked)
    yield made
    for rt in made:
        rt.close()
