"""ClusterWriter: committed pages to the cluster on a thread of its own.

The core offers pages it protects (their host slots are neither evicted nor reused) and
hears back per offer when they are written or given up, so a commit never waits for the
network. What is queued is bounded in bytes: an offer that does not fit, or one made
while the cluster is failing, is refused at once (counted as dropped), never queued
without bound and never blocking.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier_client.ids import Slot

from kvtier.mechanism.cluster.tier import ClusterTier

log = logging.getLogger(__name__)

#: Called once per accepted offer with each page's result (True: stored).
WriteDone = Callable[[list[bool]], None]


@dataclass
class _Offer:
    namespace: str
    pages: list[tuple[bytes, Slot | bytes]]  # (key, a host slot to read, or the page's bytes)
    done: WriteDone


class ClusterWriter:
    def __init__(self, tier: ClusterTier, view: Callable[[Slot], memoryview], *, max_bytes: int,
                 checksum: Callable[[Slot], int | None] = lambda slot: None, batch_pages: int = 64,
                 retry_interval: float = 1.0) -> None:
        """`view(slot)` is a host page and `checksum(slot)` the xxh3-64 it was published
        with, if known (not hashed again); `max_bytes` bounds what is queued or in flight;
        `batch_pages` pages go in one batch; while the cluster fails, one offer per
        `retry_interval` is tried and the rest refused."""
        self.tier = tier
        self.view = view
        self.checksum = checksum
        self.max_bytes = max_bytes
        self.batch_pages = batch_pages
        self.retry_interval = retry_interval
        self._queue: deque[_Offer] = deque()
        self._bytes = 0
        self._last_try = 0.0
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvtier-cluster-write-{tier.layout_id}", daemon=True)
        self._thread.start()

    def offer(self, namespace: str, pages: Sequence[tuple[bytes, Slot | bytes]], done: WriteDone) -> bool:
        """Queue (key, host slot or page bytes) pages for writing; `done` is called on the
        writer's thread with their results. False (nothing queued, `done` never called)
        when they do not fit or the cluster is failing."""
        size = len(pages) * self.tier.page_bytes
        with self._cond:
            now = time.monotonic()
            refused = self._closed or self._bytes + size > self.max_bytes
            if not refused and self.tier.failing:
                refused = now - self._last_try < self.retry_interval
                if not refused:
                    self._last_try = now
            if not refused:
                self._queue.append(_Offer(namespace, list(pages), done))
                self._bytes += size
                self._cond.notify()
        if refused:
            self.tier.dropped(len(pages))
        return not refused

    def queued_bytes(self) -> int:
        with self._cond:
            return self._bytes

    def _next(self) -> list[_Offer]:
        """Offers to write together: at least one, up to `batch_pages` pages."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            batch, pages = [], 0
            while self._queue and (not batch or pages + len(self._queue[0].pages) <= self.batch_pages):
                offer = self._queue.popleft()
                batch.append(offer)
                pages += len(offer.pages)
            return batch

    def _run(self) -> None:
        while batch := self._next():
            results: dict[int, list[bool]] = {}
            by_namespace: dict[str, list[_Offer]] = {}
            for offer in batch:
                by_namespace.setdefault(offer.namespace, []).append(offer)
            for namespace, offers in by_namespace.items():
                try:
                    self._write(namespace, offers, results)
                except Exception:  # a bug, not a cluster fault (those are misses): keep the thread
                    log.exception("cluster write failed")
            for offer in batch:
                with self._cond:
                    self._bytes -= len(offer.pages) * self.tier.page_bytes
                try:
                    offer.done(results.get(id(offer), [False] * len(offer.pages)))
                except Exception:
                    log.exception("cluster write completion failed")

    def _write(self, namespace: str, offers: list[_Offer], results: dict[int, list[bool]]) -> None:
        pages = [page for offer in offers for page in offer.pages]
        items = [(key, memoryview(page) if isinstance(page, bytes) else self.view(page)) for key, page in pages]
        sums = [None if isinstance(page, bytes) else self.checksum(page) for _, page in pages]
        stored = iter(self.tier.write_each(namespace, items, sums))
        for offer in offers:
            results[id(offer)] = [next(stored) for _ in offer.pages]

    def close(self) -> None:
        """Write what is queued, then stop; a second call does nothing."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
