"""Pins that hold: every hard-pinned block gets a host copy, however it came to be pinned.

A hard pin keeps a block's host copy from eviction (kvtier.policy.classes), so it holds
only what is in host. A block can be hard-pinned with no host copy: pinned on disk, its pin
restored from the hints file over a disk-only block (a cold restart, or a warm one after a
pin that had not loaded yet), or its load refused because the prefetch queue was full or
the host had no room (pages leased, held or guaranteed to others). Such a block *waits*
here until a load brings it into host; from then on the pin holds it there.

    pinned(ns, keys)  just hard-pinned: start loading those not in host, now
    want(refs)        a restart's hard pins: they wait for the next sweep
    sweep()           start loads for every block still waiting
    count(ns)         the namespace's hard pins in host, loading, waiting (stats)

Why a sweep, not an event: room in host appears through many doors (a lease released, a
session ended, a held prefetch expired, a quota changed, a load finished or withdrawn)
and the prefetch queue drains on the disk port's threads; waking on each would tie all of
those rooms to this one. The pool's hint keeper calls `sweep` once a second
(kvtier.server.hint_keeper), and right after a restart's hints are restored. A sweep
looks only at the blocks waiting (none, once every pin holds), and asks at most one
prefetch per namespace, which stops at the first refusal: it never spins.

Loads are the store's own prefetches (kvtier.core.reads), so room is made for the
namespace as for any prefetch (its quota; never a held prefetched page). Hard pins never
exceed the namespace's guaranteed host pages (kvtier.core.control refuses, and turns the
excess of a lowered guarantee soft), so these loads stay within the guarantee. They run
in a session of their own, so a client's session ending never withdraws them.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvtier_client.ids import SessionId
from kvtier_client.tiers import Tier

from kvtier.core.index import BlockIndex
from kvtier.policy import Ref
from kvtier.policy.classes import Rank

#: The session hard pins' loads run in: no client's, so no session end withdraws them.
PIN_SESSION = SessionId("kvtier-hard-pins")


@dataclass(frozen=True)
class PinnedPages:
    """One namespace's hard-pinned blocks by where their host copy is."""

    in_host: int = 0  # loaded: the pin holds it
    loading: int = 0  # on its way from disk (or the cluster)
    waiting: int = 0  # no host copy yet: a sweep starts its load when there is room


class PinLoads:
    def __init__(self, index: BlockIndex, lock: threading.RLock,
                 prefetch: Callable[[SessionId, str, list[bytes]], int]) -> None:
        """`prefetch(session, namespace, keys)`: the store's prefetch into host; returns how
        many leading keys it took."""
        self.index = index
        self.hints = index.hints
        self._lock = lock
        self._prefetch = prefetch
        #: Hard-pinned refs last seen without a loaded host copy. A ref leaves once seen
        #: loaded (a hard-pinned host copy is never evicted), unpinned or gone.
        self._waiting: set[Ref] = set()

    def want(self, refs: Iterable[Ref]) -> None:
        """`refs` were hard-pinned (the store's lock held): those not loaded in host wait."""
        blocks = self.index.blocks
        for ref in refs:
            block = blocks.get(ref)
            if block is None:
                continue
            copy = block.copies.get(Tier.HOST)
            if copy is None or copy.loading:
                self._waiting.add(ref)

    def pinned(self, namespace: str, keys: list[bytes]) -> int:
        """`keys` of `namespace` were just hard-pinned: start loading those with no host
        copy now (the lock not held); those it cannot load wait for a sweep. Returns how
        many of those the prefetch took."""
        with self._lock:
            self.want((namespace, key) for key in keys)
            cold = self._settle([(namespace, key) for key in dict.fromkeys(keys)]).get(namespace, [])
        return self._prefetch(PIN_SESSION, namespace, cold) if cold else 0

    def sweep(self) -> int:
        """Start loads for the waiting blocks that have no host copy (the lock not held).
        Returns how many of those the prefetches took."""
        with self._lock:
            if not self._waiting:
                return 0
            cold = self._settle(list(self._waiting))
        return sum(self._prefetch(PIN_SESSION, namespace, keys) for namespace, keys in cold.items())

    def _settle(self, refs: list[Ref]) -> dict[str, list[bytes]]:
        """Forget the waiting refs among `refs` that are loaded, unpinned or gone; returns
        the keys of those with no host copy, by namespace, in order (those loading keep
        waiting)."""
        blocks, now = self.index.blocks, self.hints.clock()
        cold: defaultdict[str, list[bytes]] = defaultdict(list)
        for ref in [r for r in refs if r in self._waiting]:
            block = blocks.get(ref)
            hint = self.hints.get(ref, now)
            if block is None or hint is None or hint.rank is not Rank.HARD_PIN:
                self._waiting.discard(ref)
            elif (copy := block.copies.get(Tier.HOST)) is None:
                cold[ref[0]].append(ref[1])
            elif not copy.loading:
                self._waiting.discard(ref)
        return cold

    def count(self, namespace: str) -> PinnedPages:
        """The namespace's hard pins by where their host copy is (the lock held): counted
        from the blocks themselves, not from what this room expects."""
        blocks, now = self.index.blocks, self.hints.clock()
        in_host = loading = waiting = 0
        for ref in self.hints.hard:
            block = blocks.get(ref) if ref[0] == namespace and self.hints.get(ref, now) else None
            if block is None:
                continue
            copy = block.copies.get(Tier.HOST)
            if copy is None:
                waiting += 1
            elif copy.loading:
                loading += 1
            else:
                in_host += 1
        return PinnedPages(in_host, loading, waiting)
