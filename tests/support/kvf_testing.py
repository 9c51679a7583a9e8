"""Helpers shared by test files (tests/support is put on sys.path by conftest)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def segments(directory: str | os.PathLike[str]) -> list[str]:
    """Names of kvfabric shared-memory segments in ``directory``."""
    return sorted(n for n in os.listdir(directory) if n.startswith("kvf."))


def kvfabric_command() -> list[str]:
    """The ``kvfabric`` console script of the interpreter running the tests (installed next
    to it), else ``python -m kvfabric.cli``; never another install found on ``PATH``."""
    script = Path(sys.executable).with_name("kvfabric")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvfabric.cli"]
