"""A torch Llama with a paged KV cache that calls kvfabric's sparse-attention hooks (the
harness the sparse benchmarks and tests share; see ``engine.PagedEngine``)."""
