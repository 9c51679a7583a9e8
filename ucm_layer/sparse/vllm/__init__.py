"""kvfabric's sparse decode attention inside a vLLM engine, through vLLM's attention
backend registry (no patches).

``cpu``: the ``CPU_ATTN`` slot's override (vLLM's CPU build always picks that slot);
``cuda``: the ``CUSTOM`` backend for ``--attention-backend CUSTOM`` on NVIDIA GPUs. Both wrap
the platform's own backend class and its impl: the metadata builder, the KV cache layout and
the cache update stay vLLM's; ``runtime`` maps vLLM's per-layer forward onto the
``UcmSparseBase`` hooks, ``rewrite`` turns a plugin's per-head block selection into the
block table and sequence lengths the platform kernel reads, ``config`` reads and validates
the configuration. Nothing here is imported unless vLLM loads the backend.
"""
