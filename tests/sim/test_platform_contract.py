"""The platform contract on the sim backend."""

import pytest
from platform_contract import *  # noqa: F403


@pytest.fixture
def spec():
    return "sim"
