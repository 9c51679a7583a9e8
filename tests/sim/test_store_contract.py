"""The store conformance suite on every store and pipeline (sim platform)."""

import pytest
from store_contract import *  # noqa: F403
from stores import STORE_SPECS


@pytest.fixture(params=STORE_SPECS)
def store_spec(request):
    return request.param
