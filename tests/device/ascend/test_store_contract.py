"""The store conformance suite on a real Ascend NPU (skipped without one, or without torch_npu)."""

import glob
import importlib.util

import pytest
from store_contract import *  # noqa: F403
from stores import STORE_SPECS

if importlib.util.find_spec("torch_npu") is None:
    pytest.skip("torch_npu is not installed (pip install 'kvfabric[ascend]')", allow_module_level=True)
if not glob.glob("/dev/davinci[0-9]*"):
    pytest.skip("no Ascend NPU on this machine (/dev/davinci* absent)", allow_module_level=True)


@pytest.fixture
def spec():
    return "ascend"


@pytest.fixture(params=STORE_SPECS)
def store_spec(request):
    return request.param
