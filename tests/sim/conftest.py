"""Sim-tier wiring: ``KVFABRIC_TEST_CPU_HOG=1`` runs the whole tier next to busy-loop processes.

The hog (``tests/support/cpuhog.py``; ``KVFABRIC_TEST_CPU_HOG_PROCS``, default two per
core) starts before the first sim test and is killed, process by process, after the last.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cpuhog import CpuHog, background_hog_from_env


@pytest.fixture(scope="session", autouse=True)
def cpu_hog_from_env() -> Iterator[CpuHog | None]:
    with background_hog_from_env() as hog:
        yield hog
