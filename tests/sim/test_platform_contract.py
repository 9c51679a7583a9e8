"""The platform contract on the sim backend."""

from platform_contract import *  # noqa: F403
from platforms import spec_fixture

spec = spec_fixture("sim")
