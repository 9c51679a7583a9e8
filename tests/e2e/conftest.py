"""End-to-end tier: a real vLLM engine on CPU (tests arrive with the KV connector)."""
