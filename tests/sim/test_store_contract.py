"""The store conformance suite on every store and pipeline, on the sim platform."""

import pytest
from store_contract import *  # noqa: F403
from stores import STORE_SPECS


@pytest.fixture
def spec():
    return "sim"


@pytest.fixture(params=STORE_SPECS)
def store_spec(request):
    return request.param
