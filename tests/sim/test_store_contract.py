"""The store conformance suite on every store and pipeline, on the sim platform."""

from platforms import spec_fixture
from store_contract import *  # noqa: F403
from stores import store_spec  # noqa: F401

spec = spec_fixture("sim")
