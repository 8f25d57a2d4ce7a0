"""Tier benchmark: what a page costs through a real pool, next to the raw operation under it.

For each page size, every repetition builds a fresh `kvtier.server.pools.Pool` (a real /dev/shm
arena, a real disk tier under the bench directory, write-back, fsync on) and measures, in
the same run and on the same buffers, each tier operation and its baseline:

    op          tier, through the Pool                        baseline, same bytes and buffers
    host put    borrow + np.copyto engine -> page + commit    np.copyto engine -> the same arena pages
    host get    acquire + np.copyto page -> engine + release  np.copyto the same arena pages -> engine
    disk write  borrows that evict every host page: demotion  pwrite of the same host slots to a raw
                (pwrite per page, xxh3-64, fdatasync and      file, one page per call, fdatasync
                LMDB commit per batch)                        per batch
    disk read   acquire of disk-only pages: promotion         pread of the raw file into the same
                (pread per page + checksum) + release         host slots, one page per call

Timings are phase by phase (all N pages through the tier, all N through the baseline), the
order of tier and baseline alternating between repetitions, except for disk read, whose
baseline always goes first because it reads into the free host slots the promotion then
fills. Both sides of the disk rows use O_DIRECT through the same helper as the tier
(kvtier.mechanism.directio); where the filesystem refuses it both fall back to buffered I/O,
the page cache is dropped with fadvise before reads, and the result says so.

Ratios are tier / baseline throughput: 1.0 means the tier adds nothing to the raw
operation. Each figure is the median over repetitions. Nothing here asserts a speed.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier
from kvtier_client.views import HostArenaView

from kvtier_bench.harness import (
    BATCH,
    ENGINE_RING_BYTES,
    KiB,
    MiB,
    OpResult,
    batches,
    bench_dir,
    drop_cache,
    filesystem_of,
    format_size,
    layout_for,
    machine_info,
    median_pair,
    progress_bar,
    timed,
    utc_now,
    verify,
)
from kvtier_bench.internals import WriteGrant, bench_pool, open_direct
from kvtier_bench.peers.kvtier import KvtierPages

#: Without --pages, each page size moves this many bytes per measurement (long enough to
#: dwarf timer and scheduler noise, and far larger than any CPU cache).
DEFAULT_BYTES = 1024 * MiB
QUICK_BYTES = 64 * MiB
DEFAULT_REPS = 5
_NAMESPACE = "bench"
_SESSION = "bench"
DEFAULT_PAGE_SIZES = (256 * KiB, 2 * MiB)

OPS = ("host put", "host get", "disk write", "disk read")
BASELINES = {
    "host put": "np.copyto",
    "host get": "np.copyto",
    "disk write": "O_DIRECT pwrite",
    "disk read": "O_DIRECT pread",
    # With through_daemon: the same host ops through a `kvtier serve` subprocess and the
    # client's shared-memory mapping (run_client_host).
    "host put (client)": "np.copyto",
    "host get (client)": "np.copyto",
}
CLIENT_OPS = ("host put (client)", "host get (client)")


def default_pages(page_bytes: int, quick: bool = False) -> int:
    return max(1, (QUICK_BYTES if quick else DEFAULT_BYTES) // page_bytes)


@dataclass(frozen=True)
class SizeInfo:
    page_bytes: int
    pages: int
    slot_bytes: int
    description: str
    layout: PageLayout


@dataclass(frozen=True)
class BenchResult:
    date: str
    machine: dict
    directory: str
    filesystem: str
    direct_io: bool
    batch: int
    reps: int
    sizes: tuple[SizeInfo, ...]
    results: tuple[OpResult, ...]

    @property
    def notes(self) -> list[str]:
        notes = []
        if self.filesystem.split()[0] in ("tmpfs", "ramfs"):
            notes.append(f"{self.directory} is on {self.filesystem.split()[0]}: the disk rows measure memory, not a disk")
        if not self.direct_io:
            notes.append(
                f"the filesystem of {self.directory} ({self.filesystem}) refused O_DIRECT: the disk tier and the "
                "baseline both used buffered I/O (page cache dropped with fadvise before reads; on tmpfs the "
                "page cache is the storage, so disk rows measure memory)"
            )
        return notes

    def as_dict(self) -> dict:
        return {
            "date": self.date,
            "machine": self.machine,
            "dir": self.directory,
            "filesystem": self.filesystem,
            "direct_io": self.direct_io,
            "batch": self.batch,
            "reps": self.reps,
            "sizes": [
                {
                    "page_bytes": s.page_bytes,
                    "pages": s.pages,
                    "slot_bytes": s.slot_bytes,
                    "description": s.description,
                    "layout": asdict(s.layout),
                }
                for s in self.sizes
            ],
            "results": [
                {
                    "page_bytes": r.page_bytes,
                    "page_size": format_size(r.page_bytes),
                    "pages": r.tier.pages,
                    "op": r.op,
                    "tier": r.tier.as_dict(),
                    "baseline": {"name": BASELINES[r.op], **r.baseline.as_dict()},
                    "ratio": r.ratio,
                }
                for r in self.results
            ],
            "notes": self.notes,
        }


class _Rep:
    """One repetition for one layout: a fresh pool and a fresh raw file in `workdir`."""

    def __init__(self, layout: PageLayout, pages: int, workdir: str, engine: np.ndarray, sink: np.ndarray) -> None:
        self.layout = layout
        self.pages = pages
        self.workdir = workdir
        self.engine = engine  # source of puts: the engine's KV, a ring of pages
        self.sink = sink  # destination of gets
        self.keys = [i.to_bytes(8, "little") for i in range(pages)]
        self.pool = bench_pool(layout, pages, workdir)
        self.store = self.pool.store
        self.host = self.pool.host
        self._write_leases: list[WriteGrant] = []
        self.raw_path = os.path.join(workdir, "raw.bin")
        self.raw_fd = -1
        try:
            self.raw_fd, self.raw_direct = open_direct(self.raw_path, os.O_RDWR | os.O_CREAT)
            os.posix_fallocate(self.raw_fd, 0, pages * layout.slot_bytes)
        except BaseException:
            self.close()
            raise

    @property
    def direct_io(self) -> bool:
        return bool(self.pool.disk.direct_io and self.raw_direct)

    def close(self) -> None:
        if self.raw_fd >= 0:
            os.close(self.raw_fd)
            self.raw_fd = -1
        self.pool.close()

    def run(self, tier_first: bool) -> dict[str, tuple[float, float]]:
        """Seconds per op: (tier, baseline).

        With `tier_first`, the baseline put rewrites the bytes the tier has just committed
        into the same slots, and the baseline write reads host slots that still hold them
        (same namespace, so never cleared): the same bytes either way.
        """

        def pair(tier: Callable[[], None], base: Callable[[], None]) -> tuple[float, float]:
            if tier_first:
                t = timed(tier)
                return t, timed(base)
            b = timed(base)
            return timed(tier), b

        tier_put, base_put = pair(self._tier_put, self._base_put)
        tier_get, base_get = pair(self._tier_get, self._base_get)
        tier_write, base_write = pair(self._tier_write, self._base_write)
        self._release_all()
        if not self.direct_io:
            drop_cache(self.raw_path)
            drop_cache(self.pool.disk.slab_path)
        base_read = timed(self._base_read)
        tier_read = timed(self._tier_read)
        self._verify()
        return {
            "host put": (tier_put, base_put),
            "host get": (tier_get, base_get),
            "disk write": (tier_write, base_write),
            "disk read": (tier_read, base_read),
        }

    # host tier
    def _ring(self, buf: np.ndarray, i: int) -> np.ndarray:
        return buf[i % len(buf)]

    def _base_put(self) -> None:
        views = [self.host.page(s) for s in range(self.pages)]
        for i, view in enumerate(views):
            np.copyto(view, self._ring(self.engine, i))

    def _tier_put(self) -> None:
        store, host = self.store, self.host
        for start, n in batches(self.pages):
            lease = store.borrow(_SESSION, _NAMESPACE, n)
            for j, slot in enumerate(lease.slots):
                np.copyto(host.page(slot), self._ring(self.engine, start + j))
            parent = self.keys[start - 1] if start else None
            store.commit(_SESSION, lease.lease_id, self.keys[start : start + n], parent=parent)

    def _base_get(self) -> None:
        views = [self.host.page(s) for s in range(self.pages)]
        for i, view in enumerate(views):
            np.copyto(self._ring(self.sink, i), view)

    def _tier_get(self) -> None:
        store, host = self.store, self.host
        for start, n in batches(self.pages):
            lease = store.acquire(_SESSION, _NAMESPACE, self.keys[start : start + n])
            for j, slot in enumerate(lease.slots):
                np.copyto(self._ring(self.sink, start + j), host.page(slot))
            store.release(_SESSION, lease.lease_id)

    # disk tier
    def _base_write(self) -> None:
        slot_bytes = self.layout.slot_bytes
        for start, n in batches(self.pages):
            for i in range(start, start + n):
                src = self.host.view(i)
                if os.pwrite(self.raw_fd, src, i * slot_bytes) != slot_bytes:
                    raise OSError(f"short write to {self.raw_path}")
            os.fdatasync(self.raw_fd)

    def _tier_write(self) -> None:
        # Every host page is cached and host-only; each borrow evicts BATCH of them, which
        # demotes them to disk (write-back). The leases are held so that no slot comes free.
        self._write_leases = [self.store.borrow(_SESSION, _NAMESPACE, n) for _, n in batches(self.pages)]

    def _release_all(self) -> None:
        for lease in self._write_leases:
            self.store.release(_SESSION, lease.lease_id)
        self._write_leases = []
        disk = self.store.stats().tier(Tier.DISK)
        if disk.cached != self.pages or disk.counters.demotions != self.pages:
            raise RuntimeError(f"expected {self.pages} pages demoted to disk, found {disk.cached} cached")

    def _base_read(self) -> None:
        slot_bytes = self.layout.slot_bytes
        for i in range(self.pages):  # into host slots that are free now
            if os.preadv(self.raw_fd, [self.host.view(i)], i * slot_bytes) != slot_bytes:
                raise OSError(f"short read from {self.raw_path}")

    def _tier_read(self) -> None:
        store = self.store
        for start, n in batches(self.pages):
            lease = store.acquire(_SESSION, _NAMESPACE, self.keys[start : start + n])
            if lease.promoted != n:
                raise RuntimeError(f"expected {n} promotions from disk, got {lease.promoted}")
            store.release(_SESSION, lease.lease_id)

    def _verify(self) -> None:
        """Outside the timings: every promoted page holds the bytes that were put."""
        for start, n in batches(self.pages):
            lease = self.store.acquire(_SESSION, _NAMESPACE, self.keys[start : start + n])
            for j, slot in enumerate(lease.slots):
                if not np.array_equal(self.host.page(slot), self._ring(self.engine, start + j)):
                    raise RuntimeError(f"page {start + j} came back from disk with other bytes")
            self.store.release(_SESSION, lease.lease_id)


# -- host rows through the daemon and the client's mapping ---------------------
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
        tier_put = timed(partial(store.put, rep, engine))
        b_put = timed(partial(base_put, store.slots))
        t_get = timed(tier_get)
        verify(engine, sink, store.pages, "kvtier get through the client")
        b_get = timed(partial(base_get, store.slots))
    else:
        b_put = timed(partial(base_put, range(store.pages)))
        tier_put = timed(partial(store.put, rep, engine))
        b_get = timed(partial(base_get, store.slots))
        t_get = timed(tier_get)
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
    np.copyto into / out of the same arena pages (the client's own mapping), medians over `reps`."""
    seconds: dict[str, list[tuple[float, float]]] = {op: [] for op in CLIENT_OPS}
    with progress_bar(progress, f"tiers {page_bytes // 1024} KiB via the daemon", reps) as advance:
        for rep in range(reps):
            progress(f"{page_bytes // 1024} KiB through the daemon and client: repetition {rep + 1} of {reps}")
            workdir = root / f"client-{page_bytes}-{rep}"
            with KvtierPages(workdir, layout, pages, batch=batch) as store:
                store.warm()
                put, get = _client_rep(store, store.arena(), engine, sink, rep)
            shutil.rmtree(workdir, ignore_errors=True)
            seconds["host put (client)"].append(put)
            seconds["host get (client)"].append(get)
            advance()
    return [median_pair(pages, page_bytes, op, seconds[op]) for op in CLIENT_OPS]


def run_tiers(
    page_sizes: Sequence[int] = DEFAULT_PAGE_SIZES,
    *,
    pages: int | None = None,
    quick: bool = False,
    directory: str | None = None,
    reps: int | None = None,
    through_daemon: bool = False,
    progress: Callable[[str], None] = lambda message: None,
) -> BenchResult:
    """Run the benchmark. `pages` per page size defaults to DEFAULT_BYTES (QUICK_BYTES with
    `quick`) worth of pages; `reps` to DEFAULT_REPS (1 with `quick`). `directory` holds the
    disk tier and the raw file (in a temporary subdirectory, removed afterwards); default
    /var/tmp, a real disk. With `through_daemon`, each page size also gets the host rows
    through a real daemon subprocess and the client's mapping (run_client_host)."""
    reps = reps if reps is not None else (1 if quick else DEFAULT_REPS)
    if (pages is not None and pages <= 0) or reps <= 0:
        raise ValueError("pages and reps must be positive")
    sizes = [(size, pages or default_pages(size, quick), *layout_for(size)) for size in dict.fromkeys(page_sizes)]
    parent = bench_dir(directory)
    root = tempfile.mkdtemp(prefix="kvtier-bench-", dir=parent)
    results: list[OpResult] = []
    direct = True
    rng = np.random.default_rng(0)
    try:
        for size, n_pages, description, layout in sizes:
            ring = max(1, min(n_pages, ENGINE_RING_BYTES // layout.page_bytes))
            engine = rng.integers(0, 256, size=(ring, layout.page_bytes), dtype=np.uint8)
            sink = np.empty_like(engine)
            sink.fill(1)  # fault it in now: np.zeros would map it lazily
            seconds: dict[str, list[tuple[float, float]]] = {op: [] for op in OPS}
            with progress_bar(progress, f"tiers {format_size(size)}", reps) as advance:
                for rep in range(reps):
                    progress(f"{format_size(size)}: repetition {rep + 1} of {reps}")
                    workdir = os.path.join(root, f"{size}-{rep}")
                    os.makedirs(workdir)
                    bench = _Rep(layout, n_pages, workdir, engine, sink)
                    try:
                        direct = direct and bench.direct_io
                        for op, pair in bench.run(tier_first=rep % 2 == 1).items():
                            seconds[op].append(pair)
                    finally:
                        bench.close()
                        shutil.rmtree(workdir)
                    advance()
            results.extend(median_pair(n_pages, size, op, seconds[op]) for op in OPS)
            if through_daemon:
                results.extend(run_client_host(size, layout, n_pages, engine, sink, reps=reps, root=Path(root),
                                               progress=progress))
            del engine, sink
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return BenchResult(
        date=utc_now(),
        machine=machine_info(),
        directory=parent,
        filesystem=filesystem_of(parent),
        direct_io=direct,
        batch=BATCH,
        reps=reps,
        sizes=tuple(SizeInfo(size, n, layout.slot_bytes, description, layout) for size, n, description, layout in sizes),
        results=tuple(results),
    )


COLUMNS = ("page", "op", "tier pages/s", "tier GB/s", "baseline", "base pages/s", "base GB/s", "ratio")


def format_table(result: BenchResult) -> str:
    m = result.machine
    lines = [
        f"kvtier bench tiers, {result.date}: {result.batch} pages per borrow/acquire, median of {result.reps}",
        f"machine  {m['nproc']} CPUs ({m['cpu']}), {m['ram_bytes'] / 2**30:.1f} GiB RAM, Linux {m['kernel']}",
        f"disk dir {result.directory} ({result.filesystem}), O_DIRECT {'yes' if result.direct_io else 'NO'}",
    ]
    for s in result.sizes:
        shape = "x".join(map(str, s.layout.shape))
        lines.append(
            f"size     {format_size(s.page_bytes)} = [{shape}] {s.layout.dtype} ({s.description}), "
            f"slot {s.slot_bytes} B; {s.pages} pages ({s.pages * s.page_bytes / 2**20:,.0f} MiB) per measurement"
        )
    lines.append("")
    rows = [COLUMNS]
    for r in result.results:
        rows.append(
            (
                format_size(r.page_bytes),
                r.op,
                f"{r.tier.pages_per_s:,.0f}",
                f"{r.tier.gb_per_s:.2f}",
                BASELINES[r.op],
                f"{r.baseline.pages_per_s:,.0f}",
                f"{r.baseline.gb_per_s:.2f}",
                f"{r.ratio:.2f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    left = {0, 1, 4}
    for row in rows:
        cells = [cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    lines.append("")
    lines.append("ratio = tier throughput / baseline throughput (1.00: the tier adds nothing)")
    for note in result.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
