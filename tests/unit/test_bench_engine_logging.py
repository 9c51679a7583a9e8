"""The filter that keeps vLLM's chat-template warm-up failure (an engine built without a
tokenizer, on purpose) out of the demo's and benchmarks' output, and nothing else."""

from __future__ import annotations

import logging

from kvfabric.harness.engine import _NoTokenizerWarmup


def _record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("vllm.renderers.base", logging.WARNING, __file__, 1, msg, None, None)


def test_drops_only_the_warmup_failure():
    f = _NoTokenizerWarmup()
    assert f.filter(_record("Chat template warmup failed")) is False
    assert f.filter(_record("Using None for EOS token id because tokenizer is not initialized"))
    assert f.filter(_record("something else failed"))
