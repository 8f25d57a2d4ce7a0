"""Pages through the real thing: a `kvtier serve` subprocess and a `KVTierClient` that maps
its host arena, the way an engine on the same host uses kvtier.

    put  borrow 16 pages, np.copyto the engine's page bytes into each lease page view
         (the client's shared-memory mapping), commit under 16 keys
    get  acquire 16 keys, np.copyto each lease page view into the engine's buffer, release

`KvtierPages` is that store; `kvtier bench peers` uses it as the kvtier row, and
`run_client_host` measures it against np.copyto into the same arena pages (the tiers
benchmark's host rows through the daemon instead of an in-process Pool).

Every repetition gets a fresh daemon whose host tier holds exactly the pages moved, so
nothing is evicted while measuring; before timing, every slot is written once through
the client's mapping (and the baseline's), so neither side pays first-touch page faults.
"""
from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import numpy as np
from kvtier_client import KVTierClient
from kvtier_client.layout import PageLayout
from kvtier_client.remote import RemotePages
from kvtier_client.views import HostArenaView

from kvtier.bench.services import kvtier_daemon
from kvtier.bench.tiers import BATCH, OpResult, Rate

NAMESPACE = "bench"


def batches(pages: int, batch: int = BATCH) -> list[tuple[int, int]]:
    return [(start, min(batch, pages - start)) for start in range(0, pages, batch)]


def page_key(rep: int, i: int) -> bytes:
    return b"bench" + rep.to_bytes(4, "little") + i.to_bytes(8, "little")


def raw(page: np.ndarray) -> np.ndarray:
    """A lease page view (shaped like the layout) as its page_bytes uint8."""
    return page.reshape(-1).view(np.uint8)


class KvtierPages:
    """A fresh daemon with a host tier of exactly `pages` pages of `layout`, and a registered client.

    With `remote`, the client does not map the arena: page bytes go through gRPC
    (kvtier_client.remote.RemotePages, the slow path for a client on another host).
    """

    def __init__(self, workdir: Path, layout: PageLayout, pages: int, *, remote: bool = False,
                 batch: int = BATCH) -> None:
        self.workdir = workdir
        self.layout = layout
        self.pages = pages
        self.remote = remote
        self.batch = batch  # pages per borrow / acquire
        self.service, target = kvtier_daemon(workdir, host_bytes=pages * layout.slot_bytes)
        try:
            self.client = KVTierClient(target, name="kvtier-bench", map_arena=not remote)
            self.client.register(NAMESPACE, layout)
            self.remote_pages = RemotePages(self.client) if remote else None
        except BaseException:
            self.service.stop()
            raise
        self.slots: list[int] = []  # slot of page i after the last put

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.service.stop()

    def __enter__(self) -> KvtierPages:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def warm(self) -> None:
        """Write every slot once through the client's mapping, then free them all again."""
        if self.remote:
            return
        leases = [self.client.borrow(n) for _, n in batches(self.pages, self.batch)]
        for lease in leases:
            for page in lease.pages:
                raw(page).fill(0)
        for lease in leases:
            self.client.release(lease)

    def put(self, rep: int, engine: np.ndarray) -> None:
        client, ring = self.client, len(engine)
        slots: list[int] = []
        parent = None
        for start, n in batches(self.pages, self.batch):
            lease = client.borrow(n)
            keys = [page_key(rep, start + j) for j in range(n)]
            if self.remote_pages is not None:
                self.remote_pages.write_pages(lease, [engine[(start + j) % ring] for j in range(n)])
            else:
                for j, page in enumerate(lease.pages):
                    np.copyto(raw(page), engine[(start + j) % ring])
            slots.extend(lease.slots)
            client.commit(lease, keys, parent=parent)
            parent = keys[-1]
        self.slots = slots

    def get(self, rep: int, sink: np.ndarray) -> None:
        client, ring = self.client, len(sink)
        for start, n in batches(self.pages, self.batch):
            lease = client.acquire([page_key(rep, start + j) for j in range(n)])
            if self.remote_pages is not None:
                pages = self.remote_pages.read_pages(lease)
            else:
                pages = lease.pages
            for j, page in enumerate(pages):
                np.copyto(sink[(start + j) % ring], raw(page))
            client.release(lease)

    def arena(self) -> HostArenaView:
        """The bench's own mapping of the daemon's host arena (for the np.copyto baseline)."""
        info = self.client.pool
        return HostArenaView.open(info.host_arena, info.host_arena_bytes, info.layout, info.page_bytes, info.slot_bytes)


def verify(engine: np.ndarray, sink: np.ndarray, pages: int, what: str) -> None:
    """Outside the timings: the pages that landed last in each sink slot are the engine's."""
    ring = len(engine)
    for i in range(max(0, pages - ring), pages):
        if not np.array_equal(sink[i % ring], engine[i % ring]):
            raise RuntimeError(f"{what}: page {i} came back with other bytes")


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


CLIENT_OPS = ("host put (client)", "host get (client)")


def _client_rep(store: KvtierPages, arena: HostArenaView, engine: np.ndarray, sink: np.ndarray,
                rep: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """One repetition: ((tier put, baseline put), (tier get, baseline get)) in seconds. The
    baseline copies into and out of the slots the tier used (`store.slots` after its put),
    so both sides touch the same arena pages; odd repetitions time the tier first."""
    ring = len(engine)

    def base_put(order: Sequence[int]) -> None:
        for i, slot in enumerate(order):
            np.copyto(arena.raw(slot, writable=True), engine[i % ring])

    def base_get(order: Sequence[int]) -> None:
        for i, slot in enumerate(order):
            np.copyto(sink[i % ring], arena.raw(slot, writable=False))

    def tier_get() -> None:
        store.get(rep, sink)

    base_put(range(store.pages))  # warm the bench's own mapping, untimed
    if rep % 2:
        tier_put = _timed(partial(store.put, rep, engine))
        b_put = _timed(partial(base_put, store.slots))
        t_get = _timed(tier_get)
        verify(engine, sink, store.pages, "kvtier get through the client")
        b_get = _timed(partial(base_get, store.slots))
    else:
        b_put = _timed(partial(base_put, range(store.pages)))
        tier_put = _timed(partial(store.put, rep, engine))
        b_get = _timed(partial(base_get, store.slots))
        t_get = _timed(tier_get)
        verify(engine, sink, store.pages, "kvtier get through the client")
    return (tier_put, b_put), (t_get, b_get)


def run_client_host(
    page_bytes: int,
    layout: PageLayout,
    pages: int,
    engine: np.ndarray,
    sink: np.ndarray,
    *,
    reps: int,
    root: Path,
    batch: int = BATCH,
    progress: Callable[[str], None] = lambda message: None,
) -> list[OpResult]:
    """Host put and get through a daemon subprocess and the client's mapping, each next to
    np.copyto into / out of the same arena pages (mapped by this process), medians over `reps`."""
    seconds: dict[str, list[tuple[float, float]]] = {op: [] for op in CLIENT_OPS}
    for rep in range(reps):
        progress(f"{page_bytes // 1024} KiB through the daemon and client: repetition {rep + 1} of {reps}")
        workdir = root / f"client-{page_bytes}-{rep}"
        with KvtierPages(workdir, layout, pages, batch=batch) as store:
            store.warm()
            arena = store.arena()
            try:
                put, get = _client_rep(store, arena, engine, sink, rep)
            finally:
                arena.close()
        shutil.rmtree(workdir, ignore_errors=True)
        seconds["host put (client)"].append(put)
        seconds["host get (client)"].append(get)
    return [
        OpResult(page_bytes, op, Rate(pages, page_bytes, statistics.median(t for t, _ in seconds[op])),
                 Rate(pages, page_bytes, statistics.median(b for _, b in seconds[op])))
        for op in CLIENT_OPS
    ]


def median_rate(pages: int, page_bytes: int, samples: Sequence[float]) -> Rate:
    return Rate(pages, page_bytes, statistics.median(samples))
