"""The platform contract on the real CudaPlatform and AscendPlatform classes, driven by
the stateful host-memory runtime of tests/support/fake_runtime.py."""

import pytest
from platform_contract import *  # noqa: F403


@pytest.fixture(params=["cuda-fake", "ascend-fake"])
def spec(request):
    return request.param
