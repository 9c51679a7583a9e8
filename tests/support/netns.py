"""The loopback-only namespace helpers live in :mod:`kvfabric.harness.netns` (the cluster
benchmark uses them too); tests import them from here."""

from kvfabric.harness.netns import run_isolated, why_not

__all__ = ["run_isolated", "why_not"]
