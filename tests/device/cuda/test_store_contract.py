"""The store conformance suite on a real NVIDIA GPU (skipped without one, or without CuPy)."""

import glob
import importlib.util
import os

import pytest
from store_contract import *  # noqa: F403
from stores import STORE_SPECS

if importlib.util.find_spec("cupy") is None:
    pytest.skip("CuPy is not installed (pip install 'kvfabric[cuda]')", allow_module_level=True)
if not (os.path.exists("/dev/nvidiactl") or glob.glob("/dev/nvidia[0-9]*")):
    pytest.skip("no NVIDIA GPU on this machine", allow_module_level=True)


@pytest.fixture
def spec():
    return "cuda"


@pytest.fixture(params=STORE_SPECS)
def store_spec(request):
    return request.param
