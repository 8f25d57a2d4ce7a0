"""The cluster tier as the core sees it: a store shared by nodes, below disk.

    present(ns, keys)     how many leading keys the cluster holds: one network round trip,
                          never under the lock
    prefetch(ns, keys)    which keys to load for nobody in particular (held once loaded):
                          those the cluster holds, up to the first this node has, as many
                          as its read queue takes; kvtier.core.loads runs their loads
    hold / write          a commit's pages go to the cluster writer, their host copies held
                          until it reports (`cluster_write = commit`)
    copy_demoted(batch)   the pages of a disk write batch that the cluster lacks go to the
                          writer as copies (`cluster_write = demote`)

Hits found here are reported as CLUSTER by lookups. Everything but `present`, `write` and
`copy_demoted` runs with the store's lock held; those take it where they need it.
"""
from __future__ import annotations

import enum
import threading

from kvtier_client.errors import CapacityError
from kvtier_client.ids import SessionId
from kvtier_client.tiers import Tier

from kvtier.core.index import Block, BlockIndex
from kvtier.core.loads import Loads
from kvtier.core.ports import LoadKind, RemotePort


class ClusterWrite(str, enum.Enum):
    """When pages are copied to the cluster tier: each page at its commit (every page, as
    soon as another node could want it), when it is demoted from host to disk (only pages
    that lived long enough to leave host, so what the node is about to forget), or never
    (the node only reads the cluster)."""

    COMMIT = "commit"
    DEMOTE = "demote"
    OFF = "off"

    def __str__(self) -> str:
        return self.value


class ClusterCopies:
    def __init__(self, index: BlockIndex, loads: Loads, remote: RemotePort, lock: threading.RLock) -> None:
        self.index = index
        self.loads = loads
        self.remote = remote
        self._lock = lock

    def present(self, namespace: str, keys: list[bytes]) -> int:
        """How many leading `keys` the cluster holds (0 when it fails); the lock released."""
        return self.remote.present(namespace, keys) if keys else 0

    def prefetch(self, session: SessionId, namespace: str, keys: list[bytes], parent: bytes | None,
                 priority: int, hold: float = 0.0) -> int:
        """Prefetch keys the cluster holds, up to the first one this node has meanwhile;
        returns how many loads started (0 when the queue is full or no room can be made)."""
        keys = keys[: self.remote.prefetch_room()]
        keys = keys[: next((i for i, key in enumerate(keys) if (namespace, key) in self.index.blocks), len(keys))]
        if not keys:
            return 0
        try:
            blocks = self.loads.start_new(session, namespace, keys, parent, Tier.CLUSTER, LoadKind.PREFETCH, priority)
        except CapacityError:
            return 0
        self.index.stop_waiting(blocks, Tier.HOST)  # nobody waits: the hold protects them once loaded
        for block in blocks:
            block.copies[Tier.HOST].job.hold = hold
        return len(blocks)

    # -- writes -----------------------------------------------------------------
    def hold(self, blocks: list[Block]) -> None:
        """Keep committed pages' host slots put until the cluster writer reports (under the lock)."""
        for b in blocks:
            b.copies[Tier.HOST].readers += 1

    def write(self, blocks: list[Block]) -> None:
        """Hand held committed pages to the cluster writer (the lock released); they are
        let go when it is done, or now if it refuses them."""
        namespace = blocks[0].ref[0]
        pages = [(b.ref[1], b.copies[Tier.HOST].slot) for b in blocks]
        if not self.remote.write(namespace, pages, lambda results: self._written(blocks, results)):
            self._written(blocks, [False] * len(blocks))

    def copy_demoted(self, blocks: list[Block]) -> None:
        """Offer the pages of a disk write batch that the cluster lacks to its writer, as
        copies (the batch protects their host slots only until it is filed)."""
        by_namespace: dict[str, list[Block]] = {}
        with self._lock:
            for block in blocks:
                if not block.in_cluster:
                    by_namespace.setdefault(block.ref[0], []).append(block)
            pages = {ns: [(b.ref[1], b.copies[Tier.HOST].slot) for b in group] for ns, group in by_namespace.items()}
        for namespace, group in by_namespace.items():
            self.remote.write(namespace, pages[namespace], lambda results, group=group:
                              self._written(group, results, held=False), copy=True)

    def _written(self, blocks: list[Block], results: list[bool], held: bool = True) -> None:
        with self._lock:
            events = self.index.events
            for b, ok in zip(blocks, results):
                if held:  # a commit's pages: their host copies were kept for the writer
                    b.copies[Tier.HOST].readers -= 1
                b.in_cluster = b.in_cluster or ok
                if ok and events is not None:
                    namespace, key = b.ref
                    events.stored(Tier.CLUSTER, namespace, key, b.parent[1] if b.parent else None, b.tokens)
            self.loads.loaded.notify_all()
