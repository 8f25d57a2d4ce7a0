"""The sink each block store tells (kvtier.core.ports.BlockEvents).

A store calls its sink with its lock held, on request threads and on the mechanism's
completion threads, so recording must cost next to nothing and never wait for the
publisher. Each pool has its own sink, and every call comes under that pool's store lock:
one producer, so a record is a tuple appended to a bounded deque, with no lock of its own
(deque appends and pops are atomic). The publisher's thread pops everything from every
sink. When it falls `capacity` records behind, the deque drops the oldest; they are counted
per namespace (a watcher of that namespace learns it missed them, and the daemon counts them
in kvtier_events_dropped_total).
"""
from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Protocol

from kvtier_client.tiers import Tier

from kvtier.events.records import Record


class HeldCopy(Protocol):
    """One copy a store holds (kvtier.core.held.HeldCopy: events never import the core)."""

    tier: Tier
    namespace: str
    key: bytes
    parent: bytes | None
    tokens: tuple[int, ...] | None


#: What a sink reads the store's whole state with (BlockStore.held): every copy in place,
#: parents first, of one namespace or (None) all.
Held = Callable[[str | None], Sequence[HeldCopy]]


class PoolEvents:
    """One pool's sink. `block_size`: the pool's tokens per block (a BlockStored names it).
    `ready` is set when records arrive; the publisher's thread waits on it. `held` reads
    the store's whole state, for re-announcing it (None: nothing to re-announce)."""

    __slots__ = ("_dropped", "_lock", "_ready", "_records", "block_size", "held")

    def __init__(self, block_size: int, capacity: int, ready: threading.Event, held: Held | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"an event sink holds at least one record, got {capacity}")
        self.block_size = block_size
        self.held = held
        self._records: deque[Record] = deque(maxlen=capacity)
        self._dropped: Counter[str] = Counter()
        self._lock = threading.Lock()  # the drop counts only: dropping is rare
        self._ready = ready

    def stored(self, tier: Tier, namespace: str, key: bytes, parent: bytes | None,
               tokens: tuple[int, ...] | None) -> None:
        self._add((True, tier, namespace, key, parent, tokens, self.block_size))

    def removed(self, tier: Tier, namespace: str, key: bytes) -> None:
        self._add((False, tier, namespace, key, None, None, self.block_size))

    def _add(self, record: Record) -> None:
        records = self._records
        if len(records) == records.maxlen:  # the append drops the oldest: count it
            with self._lock:
                self._dropped[records[0][2]] += 1
        records.append(record)
        if not self._ready.is_set():  # a read; setting takes the event's own lock
            self._ready.set()

    def take(self) -> tuple[list[Record], Counter[str]]:
        """The records waiting, oldest first, and those dropped since the last take, by
        namespace. Called by one consumer, concurrently with the store's appends."""
        records, pop = [], self._records.popleft
        for _ in range(len(self._records)):
            records.append(pop())
        with self._lock:
            dropped, self._dropped = self._dropped, Counter()
        return records, dropped

    def state(self, stored: bool, namespace: str | None = None) -> list[Record]:
        """The store's whole state as records, parents first: each copy in place arriving
        (`stored`) or leaving. Read by the publisher's thread, outside any lock of ours."""
        if self.held is None:
            return []
        size = self.block_size
        return [(stored, c.tier, c.namespace, c.key, c.parent, c.tokens if stored else None, size)
                for c in self.held(namespace)]
