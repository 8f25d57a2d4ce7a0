"""Prefetch hints: a bounded queue and one worker that loads disk pages into host ahead
of an Acquire. A full queue drops the hint (accepted = 0) instead of growing without bound:
a hint is only worth something if it runs soon."""
from __future__ import annotations

import logging
import queue
import threading

from kvtier_client.errors import KVTierError
from kvtier_client.tiers import Tier

from kvtier.server.sessions import Session

log = logging.getLogger(__name__)

_STOP = None


class Prefetcher:
    def __init__(self, max_queued: int = 256) -> None:
        self._queue: queue.Queue[tuple[Session, list[bytes], Tier] | None] = queue.Queue(max_queued)
        self._worker = threading.Thread(target=self._run, name="kvtier-prefetch", daemon=True)
        self.loaded_pages = 0

    def start(self) -> None:
        self._worker.start()

    def submit(self, session: Session, keys: list[bytes], tier: Tier) -> int:
        """Queue a hint; returns the number of keys accepted (0 when the queue is full)."""
        try:
            self._queue.put_nowait((session, keys, tier))
        except queue.Full:
            return 0
        return len(keys)

    def stop(self) -> None:
        if self._worker.is_alive():
            self._queue.put(_STOP)
            self._worker.join()

    def _run(self) -> None:
        while (job := self._queue.get()) is not _STOP:
            session, keys, tier = job
            try:
                self.loaded_pages += session.pool.store.prefetch(session.namespace, keys, tier)
            except KVTierError as exc:  # a bad hint is the client's problem, never the worker's
                log.info("prefetch hint ignored: %s", exc)
