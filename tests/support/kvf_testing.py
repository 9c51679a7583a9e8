"""Helpers shared by test files (tests/support is put on sys.path by conftest)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def segments(directory: str | os.PathLike[str]) -> list[str]:
    """Names of kvfabric shared-memory segments in ``directory``."""
    return sorted(n for n in os.listdir(directory) if n.startswith("kvf."))
