"""The platform contract on a real Ascend NPU (skipped without one, or without torch_npu)."""

from platforms import require_hardware, spec_fixture

require_hardware("ascend")

from platform_contract import *  # noqa: E402, F403

spec = spec_fixture("ascend")
