"""kvfabric.ucm_layer: KV semantics above the pool (UCM-like).

16-byte chained block ids, one async store contract with pool / posix / cache stores
composed as pipelines, the Delegator, and the vLLM KV connector.
"""
