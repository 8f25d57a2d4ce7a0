"""Pages through the real thing: a `kvtier serve` subprocess and a `KVTierClient` that maps
its host arena, the way an engine on the same host uses kvtier.

    put  borrow a batch of pages, lease.write the engine's page bytes into each page (the
         client's shared-memory mapping; a copy that hashes as it goes), commit under the
         batch's keys with the checksums
    get  acquire a batch of keys, np.copyto each lease page view into the engine's buffer, release

The calls go over the daemon's fast lane (the default client) or, with lane=False, gRPC.

`KvtierPages` is that store; `KvtierStore` is the peers benchmark's PageStore over it (the
kvtier rows, the mapping or, with `remote`, the gRPC slow path), and the tiers benchmark's
`run_client_host` measures it against np.copyto into the same arena pages (the host rows
through the daemon instead of an in-process Pool).

Every repetition gets a fresh daemon whose host tier holds exactly the pages moved, so
nothing is evicted while measuring; before timing, every slot is written once through
the client's mapping (and the baseline's), so neither side pays first-touch page faults.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from kvtier_client import KVTierClient
from kvtier_client.layout import PageLayout
from kvtier_client.remote import RemotePages
from kvtier_client.views import HostArenaView

from kvtier_bench.harness import BATCH, batches, package_version, timed
from kvtier_bench.peers.base import Context, page_key
from kvtier_bench.services import kvtier_daemon

NAMESPACE = "bench"


def raw(page: np.ndarray) -> np.ndarray:
    """A lease page view (shaped like the layout) as its page_bytes uint8."""
    return page.reshape(-1).view(np.uint8)


class KvtierPages:
    """A fresh daemon with a host tier of exactly `pages` pages of `layout`, and a registered client.

    With `remote`, the client does not map the arena: page bytes go through gRPC
    (kvtier_client.remote.RemotePages, the slow path for a client on another host).
    """

    def __init__(self, workdir: Path, layout: PageLayout, pages: int, *, remote: bool = False,
                 batch: int = BATCH, lane: bool = True) -> None:
        self.workdir = workdir
        self.layout = layout
        self.pages = pages
        self.remote = remote
        self.batch = batch  # pages per borrow / acquire
        self.service, target = kvtier_daemon(workdir, host_bytes=pages * layout.slot_bytes)
        try:
            self.client = KVTierClient(target, name="kvtier-bench", map_arena=not remote, lane=lane)
            self.client.register(NAMESPACE, layout)
            if not remote and self.client.transport != ("lane" if lane else "grpc"):
                raise RuntimeError(f"the client's calls go over {self.client.transport}, not "
                                   f"{'the lane' if lane else 'gRPC'}")
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
            else:  # copied and hashed in one pass (what engines are told to use): commit sends the sums
                for j in range(n):
                    lease.write(j, engine[(start + j) % ring])
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
        """The client's mapping of its namespace's host arena (for the np.copyto baseline)."""
        arena = self.client.host_arena
        if arena is None:
            raise RuntimeError("a remote (map_arena=False) client has no host arena to copy into")
        return arena


class KvtierStore:
    """A fresh daemon per repetition (host tier = the pages moved), the client's mapping or its
    gRPC slow path; the hot calls over the fast lane (the default client) or, with
    lane=False, over gRPC."""

    def __init__(self, ctx: Context, remote: bool, lane: bool = True) -> None:
        self.ctx, self.remote, self.lane = ctx, remote, lane
        self.store: KvtierPages | None = None
        self.prepare(-1)  # fail now if the daemon cannot start

    def prepare(self, rep: int) -> None:
        self.close()
        workdir = self.ctx.workdir / f"kvtier{'-remote' if self.remote else ''}{'' if self.lane else '-grpc'}-{rep + 1}"
        self.store = KvtierPages(workdir, self.ctx.layout, self.ctx.pages, remote=self.remote, batch=self.ctx.batch,
                                 lane=self.lane)
        self.store.warm()

    def put(self, rep: int) -> None:
        self.store.put(rep, self.ctx.engine)

    def get(self, rep: int) -> None:
        self.store.get(rep, self.ctx.sink)

    def baseline(self, rep: int) -> tuple[float, float] | None:
        """(put, get) seconds of np.copyto of the same bytes into and out of the same arena slots
        the last put used, page by page, through this process's mapping: what the put and get
        would cost with no daemon and no calls. None for the remote store (no mapping)."""
        if self.remote:
            return None
        store, ctx = self.store, self.ctx
        arena, ring = store.arena(), ctx.ring

        def put() -> None:
            for i, slot in enumerate(store.slots):
                np.copyto(arena.raw(slot, writable=True), ctx.engine[i % ring])

        def get() -> None:
            for i, slot in enumerate(store.slots):
                np.copyto(ctx.sink[i % ring], arena.raw(slot, writable=False))

        return timed(put), timed(get)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            shutil.rmtree(self.store.workdir, ignore_errors=True)
            self.store = None


def version() -> str | None:
    return package_version("kvtier")
