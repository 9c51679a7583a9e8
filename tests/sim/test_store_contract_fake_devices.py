"""The store conformance suite on the real CudaPlatform and AscendPlatform classes over the
stateful host-memory runtime of tests/support/fake_runtime.py: copies queued on a stream
run only when something waits, and every copy's direction is checked against where its
ends live, so a store that skips a synchronization or copies the wrong way fails here."""

import pytest
from store_contract import *  # noqa: F403
from stores import store_spec  # noqa: F401


@pytest.fixture(params=["cuda-fake", "ascend-fake"])
def spec(request):
    return request.param
