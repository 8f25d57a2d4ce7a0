"""How `kvtier bench node` spreads requests over a node's engines: round-robin (what a
router that knows nothing of caches does), or prefix affinity (what a KV-aware router does).
Both are deterministic: the same trace gives the same assignment every run."""
from __future__ import annotations

from collections.abc import Sequence


class RoundRobin:
    """Request i goes to engine i mod engines."""

    def __init__(self, engines: int) -> None:
        self.engines = engines
        self.sent = 0

    def route(self, ids: Sequence[int]) -> int:
        engine = self.sent % self.engines
        self.sent += 1
        return engine


class PrefixAffinity:
    """A request goes to the engine the router already sent the longest prefix of it, when
    that prefix is more than `threshold` of the request's blocks; otherwise (a new
    conversation, or one whose shared part is only a common system prompt) to the engine
    sent the fewest blocks so far. That is the cache-affinity rule of SGLang's cache-aware
    router (SMG), with its default cache-threshold of 0.3.

    Trace ids are prefix-chained, so one block names its whole prefix and an engine's match is
    the deepest block it was sent. The router keeps its own record of what it sent where, as
    llm-d's approximate prefix scorer does: it does not see what the engines' caches evicted.
    Ties go to the engine that last got the block, then to the least loaded. There is no
    load-imbalance switch: with one request in flight per engine, queues never differ."""

    def __init__(self, engines: int, threshold: float = 0.3) -> None:
        self.engines = engines
        self.threshold = threshold
        self.sent_to: dict[int, int] = {}  # block -> bit mask of the engines sent it
        self.last: dict[int, int] = {}  # block -> the engine last sent it
        self.load = [0] * engines  # blocks sent to each engine

    def _least_loaded(self, mask: int) -> int:
        return min((e for e in range(self.engines) if mask >> e & 1), key=lambda e: (self.load[e], e))

    def route(self, ids: Sequence[int]) -> int:
        everyone = (1 << self.engines) - 1
        matched, holders = 0, everyone  # holders: the engines sent every block of ids[:matched]
        for block in ids:
            sent = holders & self.sent_to.get(block, 0)
            if not sent:
                break
            matched, holders = matched + 1, sent
        if ids and matched > self.threshold * len(ids):
            last = self.last[ids[matched - 1]]
            engine = last if holders >> last & 1 else self._least_loaded(holders)
        else:
            engine = self._least_loaded(everyone)
        bit = 1 << engine
        for block in ids:
            self.sent_to[block] = self.sent_to.get(block, 0) | bit
            self.last[block] = engine
        self.load[engine] += len(ids)
        return engine


ROUTERS = {"round-robin": RoundRobin, "prefix-affinity": PrefixAffinity}


def make_router(name: str, engines: int) -> RoundRobin | PrefixAffinity:
    try:
        return ROUTERS[name](engines)
    except KeyError:
        raise ValueError(f"unknown routing {name!r}; use one of {', '.join(ROUTERS)}") from None
