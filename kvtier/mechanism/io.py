"""The load engines: `PageReader`, `depth` worker threads that load pages into host slots,
loads for an Acquire ahead of prefetches, with its two sources, `DiskReader` (O_DIRECT
preadv into the page itself, no bounce buffer) and `ClusterReader` (a batch of pages per
round trip); and the write-back thread that drives the core's disk writes
(`WriteBackThread`).

Random reads without readahead reach a device's bandwidth only with many requests in
flight; `depth` is that queue depth. Prefetch jobs wait in a bounded queue: when it is full
the core simply starts fewer prefetches (back-pressure), so a flood of hints can neither
grow memory nor delay an Acquire, whose jobs always go first.

A job is queued, then started (by a worker), then done; until started it can be cancelled
(its session ended) or boosted (an Acquire now waits for it). `on_done(job, ok)` runs on
the worker thread; the core takes its own lock there.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvtier.core.ports import LoadJob, LoadKind
from kvtier.mechanism.bandwidth import Throughput
from kvtier.mechanism.cluster import ClusterTier
from kvtier.mechanism.cluster.values import UNHASHED
from kvtier.mechanism.disk import DiskTier
from kvtier.mechanism.host import HostArena

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class IOStats:
    queued_acquire: int
    queued_prefetch: int
    in_flight: int
    depth: int
    failed_batches: int = 0


#: Called with (kind, seconds from enqueue to done, bytes read, ok) for every finished job.
Observer = Callable[[LoadKind, float, int, bool], None]


class PageReader:
    """The queue and workers; a source says how to read a batch of jobs (`_read`)."""

    #: Thread names: kvtier-<source>-read-<i>.
    source = "page"

    def __init__(self, host: HostArena, slot_bytes: int, *, depth: int = 8, batch: int = 1,
                 max_queued_prefetch: int = 1024, observer: Observer | None = None,
                 throughput: Throughput | None = None) -> None:
        """A worker takes up to `batch` queued jobs at once. `throughput` hears of every busy
        period (first read started to queue drained)."""
        if depth < 1:
            raise ValueError(f"io depth must be at least 1, got {depth}")
        self.host = host
        self.slot_bytes = slot_bytes
        self.depth = depth
        self.batch = batch
        self.max_queued_prefetch = max_queued_prefetch
        self.observer = observer
        self.throughput = throughput
        self._busy_since: float | None = None  # when the current busy period began
        self._busy_bytes = 0
        self._heap: list[tuple[int, int, int, LoadJob]] = []  # (kind, -priority, seq, job); may hold stale entries
        self._queued = {LoadKind.ACQUIRE: 0, LoadKind.PREFETCH: 0}
        self._in_flight = 0
        self.failed_batches = 0  # batches whose read raised (their jobs failed; see `_work`)
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name=f"kvtier-{self.source}-read-{i}", daemon=True) for i in range(depth)
        ]
        for worker in self._workers:
            worker.start()

    def prefetch_room(self) -> int:
        """How many more prefetch jobs the queue takes now."""
        with self._cond:
            return max(0, self.max_queued_prefetch - self._queued[LoadKind.PREFETCH])

    def submit(self, job: LoadJob) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.source} reader is closed")
            self._push(job)
            self._cond.notify()

    def _push(self, job: LoadJob) -> None:
        self._queued[job.kind] += 1
        heapq.heappush(self._heap, (job.kind, -job.priority, next(self._seq), job))

    def boost(self, job: LoadJob) -> None:
        """An Acquire now waits for this prefetch: run it with Acquire priority."""
        with self._cond:
            if job.started or job.cancelled or job.kind is LoadKind.ACQUIRE:
                return
            self._queued[job.kind] -= 1
            job.kind = LoadKind.ACQUIRE  # the old heap entry is skipped: its kind no longer matches
            self._push(job)
            self._cond.notify()

    def cancel(self, session: str | None, cancellable: Callable[[LoadJob], bool]) -> list[LoadJob]:
        """Withdraw the session's (None: every session's) queued jobs that `cancellable`
        allows; returns them."""
        with self._cond:
            gone = []
            for kind, _, _, job in self._heap:
                if session in (None, job.session) and kind == job.kind and not job.started and not job.cancelled and cancellable(job):
                    job.cancelled = True
                    self._queued[job.kind] -= 1
                    gone.append(job)
            return gone

    def stats(self) -> IOStats:
        with self._cond:
            return IOStats(self._queued[LoadKind.ACQUIRE], self._queued[LoadKind.PREFETCH], self._in_flight, self.depth,
                           self.failed_batches)

    def close(self) -> None:
        """Stop the workers after the jobs in flight; queued jobs are not run (their pages
        stay loading: the pool is being torn down)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for worker in self._workers:
            worker.join()

    def _next(self) -> list[LoadJob]:
        """Up to `batch` jobs, best first; empty once closed."""
        with self._cond:
            jobs: list[LoadJob] = []
            while not self._closed:
                while self._heap and len(jobs) < self.batch:
                    kind, _, _, job = heapq.heappop(self._heap)
                    if job.cancelled or job.started or kind != job.kind:
                        continue  # withdrawn, or superseded by a boosted entry
                    job.started = True
                    self._queued[job.kind] -= 1
                    self._in_flight += 1
                    jobs.append(job)
                if jobs:
                    if self._busy_since is None:
                        self._busy_since = time.monotonic()
                    return jobs
                self._cond.wait()
            return jobs

    def _end_busy_period(self) -> None:
        if self.throughput is not None and self._busy_since is not None:
            self.throughput.observe(self._busy_bytes, time.monotonic() - self._busy_since)
        self._busy_since, self._busy_bytes = None, 0

    def _read(self, jobs: list[LoadJob]) -> list[bool]:
        """Read each job's page into its host slot; False for a page that cannot be trusted."""
        raise NotImplementedError

    def _work(self) -> None:
        while jobs := self._next():
            try:
                results = self._read(jobs)
            except Exception:
                # A job this source cannot read (a bug, or a record it does not understand)
                # fails like a bad page, and its waiters are told: a worker that died here
                # would leave every later load in flight for good.
                log.exception("%s reader: a batch of %d load(s) failed; their pages are dropped", self.source, len(jobs))
                with self._cond:
                    self.failed_batches += 1
                results = [False] * len(jobs)
            with self._cond:
                self._in_flight -= len(jobs)
                self._busy_bytes += self.slot_bytes * sum(results)
                if self._in_flight == 0 and not any(self._queued.values()):
                    self._end_busy_period()
            for job, ok in zip(jobs, results):
                if self.observer is not None:
                    self.observer(job.kind, time.monotonic() - job.enqueued, self.slot_bytes, ok)
                job.on_done(job, ok)


class DiskReader(PageReader):
    """Disk pages, one per worker at a time: random reads reach the device's bandwidth
    with `depth` requests in flight."""

    source = "disk"

    def __init__(self, disk: DiskTier, host: HostArena, **options) -> None:
        self.disk = disk
        super().__init__(host, disk.layout.slot_bytes, **options)

    def _read(self, jobs: list[LoadJob]) -> list[bool]:
        (job,) = jobs
        try:
            ok = self.disk.read_page(job.record, self.host.view(job.host_slot))
            if job.record.codec:  # decoded: the checksum is the encoding's, the slot table hashes the page
                job.record = replace(job.record, length=0)
            return [ok]
        except OSError:
            # A failing device: the page cannot be trusted, so it goes like a corrupt one.
            # DiskTier.read_page counted it (io_errors) and logs once per episode.
            return [False]


class ClusterReader(PageReader):
    """Cluster pages, a batch per worker: one pipelined round trip per store node for up to
    `batch` pages of a namespace. A page the cluster no longer holds, or one that fails its
    checksum, is False like a corrupt disk page (the core drops its host copy)."""

    source = "cluster"

    def __init__(self, tier: ClusterTier, host: HostArena, *, batch: int = 32, **options) -> None:
        self.tier = tier
        super().__init__(host, tier.page_bytes, batch=batch, **options)

    def _read(self, jobs: list[LoadJob]) -> list[bool]:
        results: dict[int, bool] = {}
        by_namespace: dict[str, list[LoadJob]] = {}
        for job in jobs:
            by_namespace.setdefault(job.record.namespace, []).append(job)
        for namespace, group in by_namespace.items():
            sums = self.tier.read_checked(namespace, [j.record.key for j in group],
                                          [self.host.view(j.host_slot) for j in group])
            for job, checksum in zip(group, sums):
                if checksum is not None and checksum != UNHASHED:  # verified: the slot table takes it as it is
                    job.record = replace(job.record, length=self.tier.page_bytes, checksum=checksum)
                results[id(job)] = checksum is not None
        return [results[id(job)] for job in jobs]


class WriteBackThread:
    """The pool's write-back ("cleaner") thread: calls `step()` (one disk write batch,
    returns its page count, 0 when there is nothing to do) while there is work, and in
    between `wait(timeout)` (True when there may be work; False after `idle` seconds, and
    it waits again). A step that raises is
    logged and retried after `backoff` seconds; a failing disk fails steps without
    raising (the core counts io_errors), so the thread then idles until new work comes.

    `stop()` returns after the batch in flight has been filed: call it before the disk
    tier closes, and no write runs after that."""

    def __init__(self, step: Callable[[], int], wait: Callable[[float], bool], wake: Callable[[], None], *,
                 idle: float = 1.0, backoff: float = 1.0, name: str = "kvtier-write-back") -> None:
        """`wake()` makes a `wait` in progress return (used by `stop`)."""
        self._step = step
        self._wait = wait
        self._wake = wake
        self._idle = idle
        self._backoff = backoff
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                wrote = self._step()
            except Exception:
                log.exception("write-back step failed; retrying in %.1f s", self._backoff)
                self._stopped.wait(self._backoff)
                continue
            # Idle until woken: a store left alone (reads only) is not written behind its back.
            while not wrote and not self._stopped.is_set() and not self._wait(self._idle):
                pass

    def stop(self) -> None:
        """Stop after the step in flight; a second call does nothing."""
        self._stopped.set()
        self._wake()
        self._thread.join()
