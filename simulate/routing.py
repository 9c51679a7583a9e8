"""Routers: which engine a request goes to.

Contract: ``route(keys, load) -> engine`` with ``keys`` the request's full-block keys (the
ones a lookup may hit) and ``load[e]`` the requests engine ``e`` has queued or in service;
engines are numbered node by node (engine ``e`` is on node ``e // engines_per_node``).
A router reads but never changes the cluster's state.

* :class:`RoundRobin`: engine 0, 1, 2, ... in arrival order, whatever the prompts.
* :class:`PrefixAware`: what a router fed by the pool's KV events does. It follows the
  request's keys through the :class:`~kvfabric.simulate.tiers.KvIndex` (which nodes hold
  each key in any tier) while some node holds all of them so far; among the engines of
  the nodes holding the longest prefix it takes the least loaded (of two of them drawn at
  random when more than two nodes tie). When that engine has more than ``slack`` requests more than the
  less loaded of two random engines, or no node holds the first block, it takes that one
  instead (the power of two choices), so a popular prefix does not pile onto one node.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Hashable, Sequence

from kvfabric.simulate.config import ClusterConfig, Routing
from kvfabric.simulate.tiers import KvIndex


class RoundRobin:
    """Engines in turn (module docstring)."""

    def __init__(self, engines: int) -> None:
        self.engines = engines
        self._next = 0

    def route(self, keys: Sequence[Hashable], load: Sequence[int]) -> int:
        e = self._next
        self._next = (e + 1) % self.engines
        return e


class PrefixAware:
    """Longest cached prefix first, within a load slack (module docstring)."""

    def __init__(
        self, index: KvIndex, engines_per_node: int, engines: int, slack: int, seed: int = 0
    ) -> None:
        self.index = index
        self.per_node = engines_per_node
        self.engines = engines
        self.slack = slack
        self.rng = random.Random(seed)

    def _two_choices(self, load: Sequence[int]) -> int:
        a = self.rng.randrange(self.engines)
        b = self.rng.randrange(self.engines)
        return a if load[a] <= load[b] else b

    def route(self, keys: Sequence[Hashable], load: Sequence[int]) -> int:
        get = self.index.holders.get
        cand: int | set[int] | None = None  # the nodes holding every key so far
        for k in keys:
            h = get(k)
            if h is None:
                break
            if cand is None:
                cand = h
            elif isinstance(h, int):
                if h != cand if isinstance(cand, int) else h not in cand:
                    break
                cand = h
            elif isinstance(cand, int):
                if cand not in h:
                    break
            else:
                both = cand & h
                if not both:
                    break
                cand = both
            if isinstance(cand, int):  # one node left: going deeper cannot change the choice
                break
        fallback = self._two_choices(load)
        if cand is None:
            return fallback
        pool = (cand,) if isinstance(cand, int) else self._two_of(cand)
        per = self.per_node
        choice = min((n * per + i for n in pool for i in range(per)), key=load.__getitem__)
        if load[choice] > load[fallback] + self.slack:
            return fallback
        return choice

    def _two_of(self, nodes: set[int]) -> tuple[int, ...]:
        """Two random members of ``nodes`` (all of them when there are two or fewer)."""
        if len(nodes) <= 2:
            return tuple(nodes)
        if len(nodes) <= 64:
            t = tuple(nodes)
            return (self.rng.choice(t), self.rng.choice(t))
        n_nodes = self.engines // self.per_node
        picked = []
        for _ in range(64):  # a large set: draw nodes until two are members
            n = self.rng.randrange(n_nodes)
            if n in nodes:
                picked.append(n)
                if len(picked) == 2:
                    return tuple(picked)
        return tuple(itertools.islice(nodes, 2))


def make_router(cfg: ClusterConfig, index: KvIndex | None) -> RoundRobin | PrefixAware:
    """The router ``cfg.routing`` names (prefix-aware needs the cluster's index)."""
    if cfg.routing is Routing.ROUND_ROBIN:
        return RoundRobin(cfg.engines)
    if index is None:
        raise ValueError("prefix-aware routing needs the cluster's KV index")
    return PrefixAware(index, cfg.engines_per_node, cfg.engines, cfg.route_slack, cfg.seed)


__all__ = ["PrefixAware", "RoundRobin", "make_router"]
