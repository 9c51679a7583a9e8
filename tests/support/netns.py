"""The loopback-only namespace helpers live in :mod:`kvfabric.harness.netns` (the cluster
benchmark uses them too); tests import them from here, with :func:`scenario`, which runs
one of ``tests/support``'s two-node scripts in such a namespace."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from kvf_testing import REPO

from kvfabric.harness.netns import run_isolated, why_not


def scenario(script: str, timeout: float) -> dict[str, Any]:
    """Run ``tests/support/<script>`` in a loopback-only network namespace (the test skips
    where there is none) and return what it printed last, as JSON; AssertionError with its
    output if it failed."""
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    r = run_isolated([sys.executable, str(REPO / "tests" / "support" / script)], timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


__all__ = ["run_isolated", "scenario", "why_not"]
