"""The store conformance suite on a real NVIDIA GPU (skipped without one, or without CuPy)."""

from platforms import require_hardware, spec_fixture

require_hardware("cuda")

from store_contract import *  # noqa: E402, F403
from stores import store_spec  # noqa: E402, F401

spec = spec_fixture("cuda")
