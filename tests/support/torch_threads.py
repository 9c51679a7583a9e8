"""One torch thread for the sparse tests: when other processes hold the cores, more torch
threads than free cores make OpenMP spin and slow every matmul down many times over."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
