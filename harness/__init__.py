"""Helpers that run kvfabric against real engines and models, for the demo, the tests and
the benchmarks alike (none of them imports another's helpers).

* ``engine``: a CPU vLLM engine loading the connector (``make_engine``), its
  ``kv_transfer_config`` (``kvfabric_transfer_config``), and why vLLM cannot run here
  (``vllm_problem``);
* ``models``: the small models those engines serve (a random tiny Llama, a hybrid
  Gemma3, SmolLM2-135M-Instruct converted from its GGUF wheel);
* ``peer``: a GVA peer process that owns a window, for cross-process copies;
* ``netns``: running a command in a loopback-only network namespace (Mooncake's engine
  listens on every interface), and why that cannot be done here (``why_not``);
* ``etcd``: a real etcd on 127.0.0.1 (``etcd_server``), optionally over TLS;
* ``sparse``: the torch Llama with a paged KV cache that drives the sparse-attention
  hooks (``PagedEngine``), its tokenizer, rotary tables and the passkey task.
"""
