"""A round: one turn of a request under the store's lock, and the hand-over after it.

Under the lock a request may evict, demote from the device and drop copies. Some of what
that leaves must wait until the lock is released: disk index entries to delete (`forgets`:
the disk port deletes them) and host pages to hash into the slot table (`staged`: hashing
reads the bytes). They are queued here, and `Rounds.held` hands them to the mechanism as
the lock is released: the one place that does.

A request may run in several rounds (kvtier.core.writes.Writes.run runs it again after
writing out pages it had to evict); `tried`, kept across its rounds, holds the host pages
it already wrote to disk or tried to, so it writes each at most once and ends
(kvtier.core.disk_writes.DiskWrites.write_out_first).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvtier.core.ports import Mechanism, PageRecord
from kvtier.policy import Ref


class Rounds:
    def __init__(self, lock: threading.RLock, ports: Mechanism) -> None:
        self._lock = lock
        self.ports = ports
        #: Each thread's round in progress (a round waiting on a condition lets others run).
        self._mine = threading.local()
        #: Disk index entries to delete and host pages to hash, queued under the lock.
        self.forgets: list[PageRecord] = []
        self.staged: list[PageRecord] = []
        #: Disk index entries handed over and not yet deleted: gone from the index, still in the disk's.
        self.forgetting: set[PageRecord] = set()
        #: Notified whenever a load, a disk write or a deletion ends (what waiters wait on).
        self.changed = threading.Condition(lock)

    @property
    def tried(self) -> set[Ref]:
        """The host pages this thread's request tried to write to disk, in its rounds so far."""
        tried = getattr(self._mine, "tried", None)
        if tried is None:  # the lock held outside a round: nothing to carry over
            tried = self._mine.tried = set()
        return tried

    @contextmanager
    def held(self, tried: set[Ref] | None = None) -> Iterator[None]:
        """Hold the store's lock for one round of a request (`tried`: its pages tried so far,
        kept across its rounds); once the lock is released, hand over what was queued. A
        round inside a round (the lock re-entered) is part of the outer one."""
        mine = self._mine
        outer = getattr(mine, "depth", 0)
        with self._lock:
            mine.depth = outer + 1
            if not outer:
                mine.tried = tried if tried is not None else set()
            try:
                yield
            finally:
                mine.depth = outer
                forgets, staged = ([], []) if outer else (self._take_forgets(), self._take_staged())
                if not outer:
                    mine.tried = None
        self.ports.host.publish(staged)
        self.forget(forgets)

    def _take_forgets(self) -> list[PageRecord]:
        """The queued deletions, now in flight until deleted (`forget`)."""
        forgets, self.forgets = self.forgets, []
        self.forgetting.update(forgets)
        return forgets

    def _take_staged(self) -> list[PageRecord]:
        staged, self.staged = self.staged, []
        return staged

    def forget(self, records: list[PageRecord]) -> None:
        """Delete these disk index entries (the lock released): the disk port deletes them,
        then they stop counting as in flight."""
        if records:
            self.ports.disk.forget(records)
            with self._lock:
                self.forgetting.difference_update(records)
                self.changed.notify_all()  # for `wait_saved`
