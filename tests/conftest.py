"""Test-suite wiring: tiers by folder, shared helpers on sys.path, leak and no-test guards."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "support"))

_TIERS = {"unit": "unit", "sim": "sim", "e2e": "e2e"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(HERE).parts
        if rel and rel[0] in _TIERS:
            item.add_marker(getattr(pytest.mark, _TIERS[rel[0]]))
        elif rel and rel[0] == "device":
            item.add_marker(pytest.mark.device)
            if len(rel) > 1 and rel[1] in ("cuda", "ascend"):
                item.add_marker(getattr(pytest.mark, rel[1]))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail a run in which nothing passed (everything skipped or deselected)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or exitstatus != 0:
        return
    if not reporter.stats.get("passed"):
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED


@pytest.fixture(autouse=True)
def isolated_shm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Each test gets its own shared-memory directory (in /dev/shm when it exists), so
    tests cannot see each other's segments and a leak is attributed to the test."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="kvf-test-", dir=base) as d:
        monkeypatch.setenv("KVFABRIC_SHM_DIR", d)
        yield Path(d)


@pytest.fixture(autouse=True)
def _no_leftover_daemons() -> Iterator[None]:
    """A pool daemon a failing test started and did not stop is killed after the test."""
    yield
    helper = sys.modules.get("pool_testing")
    if helper is not None:
        helper.kill_leftovers()


@pytest.fixture
def plat() -> Iterator[object]:
    """A sim platform, closed after the test."""
    from kvfabric.platform.registry import create

    p = create("sim")
    yield p
    p.close()
