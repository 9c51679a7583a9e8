"""An auto-started pool daemon serves the whole node: it drops the CPU binding of the
process that started it (a vLLM CPU worker pins itself to its cores; a daemon sharing
them with the forward missed its RPC deadlines and every dump of that step failed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvfabric.pool.autostart import UNBIND_ENV, _spawn_env_marks_unbind, unbind_cpus


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one")
def test_unbind_widens_a_pinned_process_to_the_nodes_cpus():
    code = (
        "import os, json\n"
        "from kvfabric.pool.autostart import unbind_cpus\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "before = sorted(os.sched_getaffinity(0))\n"
        "unbind_cpus()\n"
        "print(json.dumps([before, sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(1))]))\n"
    )
    import json

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    before, after, node = json.loads(out)
    assert len(before) == 1 and after == node and len(after) > 1


def test_the_spawned_daemon_is_told_to_unbind():
    assert _spawn_env_marks_unbind()[UNBIND_ENV] == "1"
    assert unbind_cpus() is None or os.sched_getaffinity(0) == os.sched_getaffinity(1)
