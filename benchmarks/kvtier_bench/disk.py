"""Disk benchmark: the disk tier's bandwidth and a prefix's load time through a real pool,
next to raw O_DIRECT I/O of the same bytes at the same parallelism.

For each page size, every repetition builds a fresh `kvtier.server.pools.Pool` (a real /dev/shm
arena, a real disk tier under the bench directory, `io_depth` and `fsync` as given) holding
N pages in host, plus a raw file beside the tier's slab, and measures, in the same run:

    op                 tier, through the Pool                   baseline, same bytes
    write (demote)     borrows of 16 pages that evict every     pwrite of the same host slots to
                       host page: write-back demotion (pwrite    the raw file, 16 pages per batch
                       per page on io_depth threads, xxh3-64,    on io_depth threads, flushed per
                       flush and LMDB commit per batch)          the same fsync policy
    read (prefetch)    prefetch of all N disk-only pages, then   pread of the raw file into the
                       wait_loaded: DiskReader's io_depth         same host slots, io_depth threads
                       workers, preadv into the slot + xxh3-64
    read (acquire 16)  WAIT_ALL acquires of 16 pages, one after  the same preads, 16 at a time,
                       another, each released                    each 16 done before the next
    prefix prefetch    prefetch of a 4,096-token prefix's pages  pread of the same pages, io_depth
                       -> wait_loaded, in ms                     threads, in ms
    prefix acquire     one cold WAIT_ALL acquire of the prefix   the same, measured again beside it

The raw side is what the device gives Python at that queue depth: worker threads that do
nothing but the system call. Each tier/baseline pair runs back to back, its order
alternating between repetitions; the figures are medians over repetitions (the prefix pairs,
which are short, run PREFIX_SAMPLES times per repetition). Both sides use
O_DIRECT through the tier's own helper (kvtier.mechanism.directio); where the filesystem
refuses it both fall back to buffered I/O, the page cache is dropped with fadvise before
every read, and the result says so. Every page read, by either side, is compared with the
bytes that were put (outside the timings). Nothing here asserts a speed.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier_bench.harness import (
    BATCH,
    ENGINE_RING_BYTES,
    OpResult,
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
)
from kvtier_bench.internals import FsyncPolicy, bench_pool, default_tiers, open_direct
from kvtier_bench.tiers import DEFAULT_PAGE_SIZES, DEFAULT_REPS, default_pages

#: The prefix of the prefetch case: 256 pages of 16 tokens (Llama-3-8B layout), 512 of 8.
PREFIX_TOKENS = 4096
DEFAULT_IO_DEPTH = 8
#: Tier/baseline pairs per repetition for the prefix rows, which take only tens of ms.
PREFIX_SAMPLES = 3
#: How long wait_loaded may take before the benchmark calls the store stuck.
LOAD_TIMEOUT_S = 600.0

_NAMESPACE = "bench"
_SESSION = "bench"

ACQUIRE_OP = f"read (acquire {BATCH})"
BANDWIDTH_OPS = ("write (demote)", "read (prefetch)", ACQUIRE_OP)
PREFIX_OPS = ("prefix prefetch", "prefix acquire")


def baseline_name(op: str, io_depth: int) -> str:
    name = f"O_DIRECT {'pwrite' if op.startswith('write') else 'pread'} x{io_depth}"
    return f"{name}, {BATCH} at a time" if op == ACQUIRE_OP else name


@dataclass(frozen=True)
class SizeInfo:
    page_bytes: int
    pages: int
    prefix_pages: int
    slot_bytes: int
    description: str
    layout: PageLayout

    @property
    def prefix_tokens(self) -> int:
        return self.prefix_pages * self.layout.block_tokens


@dataclass(frozen=True)
class DiskBenchResult:
    date: str
    machine: dict
    directory: str
    filesystem: str
    direct_io: bool
    io_depth: int
    fsync: FsyncPolicy
    batch: int
    reps: int
    sizes: tuple[SizeInfo, ...]
    bandwidth: tuple[OpResult, ...]
    prefix: tuple[OpResult, ...]

    @property
    def notes(self) -> list[str]:
        notes = []
        fstype = self.filesystem.split()[0]
        if fstype in ("tmpfs", "ramfs"):
            notes.append(f"{self.directory} is on {fstype}: these rows measure memory, not a disk")
        if not self.direct_io:
            notes.append(
                f"the filesystem of {self.directory} ({self.filesystem}) refused O_DIRECT: the disk tier and the "
                "baseline both used buffered I/O (page cache dropped with fadvise before every read)"
            )
        return notes

    def as_dict(self) -> dict:
        def row(r: OpResult) -> dict:
            return {
                "page_bytes": r.page_bytes,
                "page_size": format_size(r.page_bytes),
                "op": r.op,
                "pages": r.tier.pages,
                "tier": r.tier.as_dict(),
                "baseline": {"name": baseline_name(r.op, self.io_depth), **r.baseline.as_dict()},
                "ratio": r.ratio,
            }

        return {
            "date": self.date,
            "machine": self.machine,
            "dir": self.directory,
            "filesystem": self.filesystem,
            "direct_io": self.direct_io,
            "io_depth": self.io_depth,
            "fsync": self.fsync.value,
            "batch": self.batch,
            "reps": self.reps,
            "prefix_samples": self.reps * PREFIX_SAMPLES,
            "sizes": [
                {
                    "page_bytes": s.page_bytes,
                    "pages": s.pages,
                    "prefix_pages": s.prefix_pages,
                    "prefix_tokens": s.prefix_tokens,
                    "slot_bytes": s.slot_bytes,
                    "description": s.description,
                    "layout": asdict(s.layout),
                }
                for s in self.sizes
            ],
            "bandwidth": [row(r) for r in self.bandwidth],
            "prefix": [row(r) | {"tier_ms": r.tier.seconds * 1e3, "baseline_ms": r.baseline.seconds * 1e3}
                       for r in self.prefix],
            "notes": self.notes,
        }


# -- the baseline -----------------------------------------------------------
class _RawFile:
    """A preallocated file beside the tier's slab, written and read by `depth` threads that do
    nothing but the system call: what the device gives Python at that queue depth."""

    def __init__(self, path: str, pages: int, slot_bytes: int, depth: int, fsync: FsyncPolicy, interval: float) -> None:
        self.path = path
        self.slot_bytes = slot_bytes
        self.depth = depth
        self.fsync = fsync
        self.interval = interval
        self.fd, self.direct_io = open_direct(path, os.O_RDWR | os.O_CREAT)
        self._threads = ThreadPoolExecutor(depth, thread_name_prefix="kvtier-bench-raw")
        try:
            os.posix_fallocate(self.fd, 0, pages * slot_bytes)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._threads.shutdown()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def write(self, views: Sequence[memoryview]) -> None:
        """Page i from views[i] to slot i, BATCH pages at a time on the threads (as the disk
        tier writes one demotion batch), flushed per the fsync policy."""
        with self._flushing():
            for start in range(0, len(views), BATCH):
                batch = range(start, min(start + BATCH, len(views)))
                for _ in self._threads.map(self._write_one, batch, (views[i] for i in batch)):
                    pass
                if self.fsync is FsyncPolicy.BATCH:
                    os.fdatasync(self.fd)

    def _write_one(self, i: int, src: memoryview) -> None:
        if os.pwrite(self.fd, src, i * self.slot_bytes) != len(src):
            raise OSError(f"short write to {self.path}")

    @contextmanager
    def _flushing(self) -> Iterator[None]:
        """With fsync = interval, flush every `interval` seconds meanwhile, as the tier's flusher does."""
        if self.fsync is not FsyncPolicy.INTERVAL:
            yield
            return
        stop = threading.Event()

        def flush_every() -> None:
            while not stop.wait(self.interval):
                os.fdatasync(self.fd)

        flusher = threading.Thread(target=flush_every, name="kvtier-bench-raw-flush", daemon=True)
        flusher.start()
        try:
            yield
        finally:
            stop.set()
            flusher.join()

    def read(self, views: Sequence[memoryview], batch: int | None = None) -> None:
        """Slot i into views[i]; each thread takes the next page as soon as its read returns.
        With `batch`, `batch` pages at a time, each batch finished before the next starts (the
        shape of one WAIT_ALL acquire after another)."""
        step = batch or max(1, len(views))
        for start in range(0, len(views), step):
            # One iterator shared by the threads: next() on a range iterator is atomic under the GIL.
            pages = iter(range(start, min(start + step, len(views))))
            for future in [self._threads.submit(self._read_each, pages, views) for _ in range(min(self.depth, step))]:
                future.result()

    def _read_each(self, pages: Iterator[int], views: Sequence[memoryview]) -> None:
        for i in pages:
            if os.preadv(self.fd, [views[i]], i * self.slot_bytes) != self.slot_bytes:
                raise OSError(f"short read from {self.path}")


# -- one repetition ---------------------------------------------------------
class _Rep:
    """One repetition for one layout: a fresh pool whose host tier holds the N pages, and a
    fresh raw file, both in `workdir`."""

    def __init__(self, layout: PageLayout, pages: int, prefix_pages: int, workdir: str, engine: np.ndarray,
                 io_depth: int, fsync: FsyncPolicy) -> None:
        self.layout = layout
        self.pages = pages
        self.prefix_pages = prefix_pages
        self.engine = engine  # the pages' bytes: page i is engine[i % len(engine)]
        self.keys = [i.to_bytes(8, "little") for i in range(pages)]
        self.pool = bench_pool(
            layout, pages, workdir, fsync=fsync, io_depth=io_depth,
            # One prefetch call queues every page (the pool default, 1024, would accept only
            # the first 1024), and a loaded page may be evicted at once, so that the
            # benchmark can send the pages back to disk-only between measurements.
            max_queued_prefetch=max(pages, default_tiers().max_queued_prefetch),
            prefetch_hold=0.0,
        )
        self.store = self.pool.store
        self.host = self.pool.host
        try:
            if self.pool.disk is None:
                raise RuntimeError("the pool was built without a disk tier")
            self.disk = self.pool.disk
            self.raw = _RawFile(os.path.join(workdir, "raw.bin"), pages, layout.slot_bytes, io_depth, fsync,
                                self.pool.config.fsync_interval)
        except BaseException:
            self.pool.close()
            raise

    @property
    def direct_io(self) -> bool:
        return bool(self.disk.direct_io and self.raw.direct_io)

    def close(self) -> None:
        try:
            self.raw.close()
        finally:
            self.pool.close()

    def _page(self, i: int) -> np.ndarray:
        return self.engine[i % len(self.engine)]

    def run(self, tier_first: bool) -> dict[str, list[tuple[float, float]]]:
        """Seconds per op: (tier, baseline) pairs, PREFIX_SAMPLES of them for the prefix ops
        (they are short), one for the others."""

        def pair(tier: Callable[[], float], base: Callable[[], float]) -> tuple[float, float]:
            if tier_first:
                t = tier()
                return t, base()
            b = base()
            return tier(), b

        def read_pair(tier: Callable[[list[bytes], list[int]], float], n: int, batch: int | None = None,
                      samples: int = 1) -> list[tuple[float, float]]:
            out = []
            for _ in range(samples):
                slots = self._next_load_slots(n)
                out.append(pair(partial(tier, self.keys[:n], slots), partial(self._raw_read, slots, batch)))
            return out

        self._fill()
        write = pair(self._tier_write, self._raw_write)
        self._to_disk_only()  # every tier read below ends with it too
        return {
            "write (demote)": [write],
            "read (prefetch)": read_pair(self._tier_prefetch, self.pages),
            ACQUIRE_OP: read_pair(self._tier_acquire_batches, self.pages, BATCH),
            "prefix prefetch": read_pair(self._tier_prefetch, self.prefix_pages, samples=PREFIX_SAMPLES),
            "prefix acquire": read_pair(self._tier_acquire_all, self.prefix_pages, samples=PREFIX_SAMPLES),
        }

    # -- setting up (untimed) --------------------------------------------------
    def _fill(self) -> None:
        """Commit the N pages into host, in key order, slot i holding page i."""
        for start in range(0, self.pages, BATCH):
            n = min(BATCH, self.pages - start)
            lease = self.store.borrow(_SESSION, _NAMESPACE, n)
            for j, slot in enumerate(lease.slots):
                np.copyto(self.host.page(slot), self._page(start + j))
            parent = self.keys[start - 1] if start else None
            self.store.commit(_SESSION, lease.lease_id, self.keys[start : start + n], parent=parent)

    def _to_disk_only(self) -> None:
        """Evict every host copy (each has a disk copy, so nothing is written) and free the
        host slots highest first: the pages are disk-only again, and the store's next loads
        fill slots 0, 1, 2, ... in order, the same slots in every measurement."""
        leases = [self.store.borrow(_SESSION, _NAMESPACE, 1) for _ in range(self.pages)]
        for lease in sorted(leases, key=lambda lease: lease.slots[0], reverse=True):
            self.store.release(_SESSION, lease.lease_id)
        host = self.store.stats().tier(Tier.HOST)
        if host is None or host.free != self.pages:
            raise RuntimeError("host tier did not empty after the evicting borrows")

    def _drop_page_cache(self) -> None:
        if not self.direct_io:
            drop_cache(self.raw.path)
            drop_cache(self.disk.slab_path)

    def _next_load_slots(self, n: int) -> list[int]:
        """The host slots the store's next n loads will fill (its allocator hands out the end
        of its free list first; after _to_disk_only, slots 0 to n-1). The baseline reads into
        the same slots: on a VM the destination pages alone can change a read's speed by a
        third (docs/benchmarks.md). _verify_tier checks that the store used them."""
        return self.store.tiers[Tier.HOST].slots.free_slots()[::-1][:n]

    def _verify_tier(self, keys: list[bytes], slots: list[int]) -> None:
        """Page i of `keys` is in host slot slots[i] with the bytes that were put."""
        lease = self.store.acquire(_SESSION, _NAMESPACE, keys, timeout=0)
        try:
            if lease.ready != len(keys) or lease.promoted:
                raise RuntimeError(f"{len(keys) - lease.ready} of {len(keys)} pages are not in host after the load")
            if list(lease.slots) != slots:
                raise RuntimeError("the store loaded into other host slots than the baseline reads into")
            for i, slot in enumerate(lease.slots):
                if not np.array_equal(self.host.page(slot), self._page(i)):
                    raise RuntimeError(f"page {i} came back from the disk tier with other bytes")
        finally:
            self.store.release(_SESSION, lease.lease_id)
        if self.disk.corrupt_pages:
            raise RuntimeError(f"{self.disk.corrupt_pages} pages failed their checksum")

    # -- write ------------------------------------------------------------------
    def _tier_write(self) -> float:
        # Every host page is cached and host-only; each borrow evicts BATCH of them, which
        # demotes them to disk (write-back). The leases are held so that no slot comes free;
        # their slots keep the pages' bytes (same namespace: never cleared).
        start = time.perf_counter()
        leases = [self.store.borrow(_SESSION, _NAMESPACE, min(BATCH, self.pages - s)) for s in range(0, self.pages, BATCH)]
        seconds = time.perf_counter() - start
        for lease in leases:
            self.store.release(_SESSION, lease.lease_id)
        disk = self.store.stats().tier(Tier.DISK)
        if disk is None or disk.cached != self.pages or disk.counters.demotions != self.pages:
            raise RuntimeError(f"expected {self.pages} pages demoted to disk, found {disk.cached if disk else 0}")
        return seconds

    def _raw_write(self) -> float:
        # Host slot i holds page i whether the tier has demoted it yet or not.
        return timed(lambda: self.raw.write([self.host.view(i) for i in range(self.pages)]))

    # -- read -------------------------------------------------------------------
    def _raw_read(self, slots: list[int], batch: int | None = None) -> float:
        """Raw slot i into host slot slots[i], free at this point (the store never reads a
        free slot), then checked."""
        self._drop_page_cache()
        seconds = timed(lambda: self.raw.read([self.host.view(s) for s in slots], batch))
        for i, slot in enumerate(slots):
            if not np.array_equal(self.host.page(slot), self._page(i)):
                raise RuntimeError(f"page {i} came back from the raw file with other bytes")
        return seconds

    def _tier_prefetch(self, keys: list[bytes], slots: list[int]) -> float:
        """Prefetch -> every page in host (wait_loaded)."""
        self._drop_page_cache()
        start = time.perf_counter()
        accepted = self.store.prefetch(_SESSION, _NAMESPACE, keys)
        loaded = self.store.wait_loaded(LOAD_TIMEOUT_S)
        seconds = time.perf_counter() - start
        if accepted != len(keys) or not loaded:
            raise RuntimeError(f"prefetch accepted {accepted} of {len(keys)} pages; all loaded: {loaded}")
        self._verify_tier(keys, slots)
        self._to_disk_only()
        return seconds

    def _tier_acquire_batches(self, keys: list[bytes], slots: list[int]) -> float:
        """WAIT_ALL acquires of BATCH pages, one after another, each released: requests."""
        self._drop_page_cache()
        start = time.perf_counter()
        for s in range(0, len(keys), BATCH):
            lease = self.store.acquire(_SESSION, _NAMESPACE, keys[s : s + BATCH], timeout=None)
            if lease.promoted != len(lease.slots):
                raise RuntimeError(f"expected {len(lease.slots)} pages loaded from disk, got {lease.promoted}")
            self.store.release(_SESSION, lease.lease_id)
        seconds = time.perf_counter() - start
        self._verify_tier(keys, slots)
        self._to_disk_only()
        return seconds

    def _tier_acquire_all(self, keys: list[bytes], slots: list[int]) -> float:
        """One cold WAIT_ALL acquire of `keys`: from the call to every page pinned in host."""
        self._drop_page_cache()
        start = time.perf_counter()
        lease = self.store.acquire(_SESSION, _NAMESPACE, keys, timeout=None)
        seconds = time.perf_counter() - start
        self.store.release(_SESSION, lease.lease_id)
        if lease.promoted != len(keys) or lease.ready != len(keys):
            raise RuntimeError(f"expected {len(keys)} pages loaded from disk, got {lease.promoted}")
        self._verify_tier(keys, slots)
        self._to_disk_only()
        return seconds


def prefix_pages_for(layout: PageLayout, pages: int) -> int:
    """Pages of a PREFIX_TOKENS-token prefix, at most `pages`."""
    return max(1, min(pages, PREFIX_TOKENS // layout.block_tokens))


def run_disk(
    page_sizes: Sequence[int] = DEFAULT_PAGE_SIZES,
    *,
    pages: int | None = None,
    io_depth: int = DEFAULT_IO_DEPTH,
    fsync: FsyncPolicy | str = FsyncPolicy.BATCH,
    quick: bool = False,
    directory: str | None = None,
    reps: int | None = None,
    progress: Callable[[str], None] = lambda message: None,
) -> DiskBenchResult:
    """Run the benchmark. `pages` per page size defaults to the tiers benchmark's 1 GiB (64
    MiB with `quick`) worth, and at least one 4,096-token prefix; `reps` to DEFAULT_REPS (1
    with `quick`). `directory` holds the disk tier and the raw file (in a temporary
    subdirectory, removed afterwards); default /var/tmp, a real disk."""
    reps = reps if reps is not None else (1 if quick else DEFAULT_REPS)
    if (pages is not None and pages <= 0) or reps <= 0 or io_depth <= 0:
        raise ValueError("pages, reps and io_depth must be positive")
    fsync = FsyncPolicy(fsync)
    sizes = []
    for size in dict.fromkeys(page_sizes):
        description, layout = layout_for(size)
        prefix_full = prefix_pages_for(layout, 1 << 62)
        n_pages = pages or max(default_pages(size, quick), prefix_full)
        sizes.append(SizeInfo(size, n_pages, prefix_pages_for(layout, n_pages), layout.slot_bytes, description, layout))
    parent = bench_dir(directory)
    root = tempfile.mkdtemp(prefix="kvtier-bench-disk-", dir=parent)
    bandwidth: list[OpResult] = []
    prefix: list[OpResult] = []
    direct = True
    rng = np.random.default_rng(0)
    try:
        for info in sizes:
            ring = max(1, min(info.pages, ENGINE_RING_BYTES // info.page_bytes))
            engine = rng.integers(0, 256, size=(ring, info.page_bytes), dtype=np.uint8)
            seconds: dict[str, list[tuple[float, float]]] = {op: [] for op in BANDWIDTH_OPS + PREFIX_OPS}
            with progress_bar(progress, f"disk {format_size(info.page_bytes)}", reps) as advance:
                for rep in range(reps):
                    progress(f"{format_size(info.page_bytes)}: repetition {rep + 1} of {reps}")
                    workdir = os.path.join(root, f"{info.page_bytes}-{rep}")
                    os.makedirs(workdir)
                    bench = _Rep(info.layout, info.pages, info.prefix_pages, workdir, engine, io_depth, fsync)
                    try:
                        direct = direct and bench.direct_io
                        for op, pairs in bench.run(tier_first=rep % 2 == 1).items():
                            seconds[op] += pairs
                    finally:
                        bench.close()
                        shutil.rmtree(workdir)
                    advance()
            for op in BANDWIDTH_OPS + PREFIX_OPS:
                n = info.prefix_pages if op in PREFIX_OPS else info.pages
                (prefix if op in PREFIX_OPS else bandwidth).append(median_pair(n, info.page_bytes, op, seconds[op]))
            del engine
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return DiskBenchResult(
        date=utc_now(),
        machine=machine_info(),
        directory=parent,
        filesystem=filesystem_of(parent),
        direct_io=direct,
        io_depth=io_depth,
        fsync=fsync,
        batch=BATCH,
        reps=reps,
        sizes=tuple(sizes),
        bandwidth=tuple(bandwidth),
        prefix=tuple(prefix),
    )


COLUMNS = ("page", "op", "tier pages/s", "tier GB/s", "baseline", "base pages/s", "base GB/s", "ratio")
PREFIX_COLUMNS = ("page", "prefix", "op", "tier ms", "baseline", "base ms", "ratio")


def _table(rows: list[tuple[str, ...]], left: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        for row in rows
    ]


def format_table(result: DiskBenchResult) -> str:
    m = result.machine
    lines = [
        (
            f"kvtier bench disk, {result.date}: io_depth {result.io_depth}, fsync {result.fsync.value}, "
            f"{result.batch} pages per borrow/acquire, median of {result.reps} "
            f"({result.reps * PREFIX_SAMPLES} for the prefix)"
        ),
        f"machine  {m['nproc']} CPUs ({m['cpu']}), {m['ram_bytes'] / 2**30:.1f} GiB RAM, Linux {m['kernel']}",
        f"disk dir {result.directory} ({result.filesystem}), O_DIRECT {'yes' if result.direct_io else 'NO'}",
    ]
    for s in result.sizes:
        shape = "x".join(map(str, s.layout.shape))
        lines.append(
            f"size     {format_size(s.page_bytes)} = [{shape}] {s.layout.dtype} ({s.description}), "
            f"slot {s.slot_bytes} B; {s.pages} pages ({s.pages * s.page_bytes / 2**20:,.0f} MiB) per measurement, "
            f"prefix {s.prefix_tokens:,} tokens = {s.prefix_pages} pages"
        )
    lines.append("")
    rows = [COLUMNS]
    for r in result.bandwidth:
        rows.append((
            format_size(r.page_bytes), r.op, f"{r.tier.pages_per_s:,.0f}", f"{r.tier.gb_per_s:.2f}",
            baseline_name(r.op, result.io_depth), f"{r.baseline.pages_per_s:,.0f}", f"{r.baseline.gb_per_s:.2f}",
            f"{r.ratio:.2f}",
        ))
    lines += _table(rows, left={0, 1, 4})
    lines.append("")
    sizes = {s.page_bytes: s for s in result.sizes}
    rows = [PREFIX_COLUMNS]
    for r in result.prefix:
        s = sizes[r.page_bytes]
        rows.append((
            format_size(r.page_bytes), f"{s.prefix_tokens:,} tok / {s.prefix_pages} pg", r.op,
            f"{r.tier.seconds * 1e3:,.1f}", baseline_name(r.op, result.io_depth),
            f"{r.baseline.seconds * 1e3:,.1f}", f"{r.ratio:.2f}",
        ))
    lines += _table(rows, left={0, 1, 2, 4})
    lines.append("")
    lines.append("ratio = tier throughput / baseline throughput = baseline ms / tier ms (1.00: the tier adds nothing)")
    for note in result.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
