"""The store conformance suite on a real Ascend NPU (skipped without one, or without torch_npu)."""

from platforms import require_hardware, spec_fixture

require_hardware("ascend")

from store_contract import *  # noqa: E402, F403
from stores import store_spec  # noqa: E402, F401

spec = spec_fixture("ascend")
