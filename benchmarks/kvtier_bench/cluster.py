"""`kvtier bench cluster`: the cluster tier (Redis Cluster below disk) on a loopback cluster
of real redis-server processes (kvtier_bench.redis_cluster), in two parts.

pages   put and get of KV pages through the cluster tier (`ClusterTier.write` / `read`: a
        header and checksum on every value, verified on the way back, each page copied
        into a preallocated host buffer) next to redis-py doing the same pipelined SET / GET
        on the same cluster, same keys, same batch size, each reply copied into the same kind
        of buffer, in the same run. The ratio tier / redis-py is what the tier's own work
        costs (target >= 0.8).
trace   the Mooncake conversation trace replayed across two real `kvtier serve` daemons,
        requests routed round-robin, each daemon with a small host and disk tier so that
        the trace evicts: once without the cluster tier, once with `--cluster` on the
        loopback cluster. Per request: lookup of its block keys; acquire + release of the
        hit prefix (whatever tier it is in); borrow + commit of the blocks after it. Block
        hit rate = blocks hit / blocks looked up, in total and per node, and where the hits
        were (host, disk, cluster). A multi-turn conversation's next turn lands on the other
        node half the time; only a tier both nodes share can serve it.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from kvtier_client.layout import PageLayout

from kvtier_bench.harness import (
    BATCH,
    ENGINE_RING_BYTES,
    KiB,
    MiB,
    Rate,
    batches,
    bench_dir,
    describe_machine,
    format_size,
    layout_for,
    machine_description,
    median_rate,
    progress_bar,
    timed,
    utc_now,
    verify,
)
from kvtier_bench.internals import ChildDaemon, read_trace
from kvtier_bench.peers.redis import version as redis_version
from kvtier_bench.redis_cluster import SETUP_HINT, LocalRedisCluster
from kvtier_bench.shared_data import absent, shown
from kvtier_bench.trace import DEFAULT_TRACE, infinite_hits

PAGE_SIZES = (256 * KiB, 2 * MiB)
DEFAULT_BYTES = 256 * MiB
QUICK_BYTES = 64 * MiB
#: ... but never fewer pages than this, so a 2 MiB measurement is more than a few round trips.
MIN_PAGES = 64
DEFAULT_REPS = 5
QUICK_REPS = 3
TARGET = 0.8  # the tier's put and get >= 0.8 x redis-py's on the same cluster
MASTERS = 3
NAMESPACE = "bench"

#: Requests of the trace replayed by default: the first 1,000 (27,305 blocks; an infinite
#: cache hits 0.21 of them); `requests=None` replays all 12,031.
TRACE_REQUESTS = 1000
#: Per node: a host tier of 1,024 pages and a disk tier of 4,096, small against the 21,514
#: distinct blocks of the first 1,000 requests, so that the nodes evict.
HOST_PAGES = 1024
DISK_PAGES = 4096
#: Tiny pages (4 KiB: 512-token blocks of a 1-layer, 1-head, head_dim 4, uint8 model): the
#: replay measures hits, not bandwidth.
TRACE_LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=4, block_tokens=512, dtype="uint8")
#: Pages per acquire or borrow: a request's prefix can be longer than one lease should pin.
LEASE_PAGES = 64
NODES = 2


# -- part 1: pages through the tier vs redis-py ------------------------------------------
@dataclass(frozen=True)
class PageRow:
    """One page size: both systems moved the same pages; medians over repetitions."""

    page_bytes: int
    pages: int
    tier_put: Rate
    tier_get: Rate
    redis_put: Rate
    redis_get: Rate

    def ratio(self, op: str) -> float:
        """The tier's throughput over redis-py's for "put" or "get"."""
        tier, base = getattr(self, f"tier_{op}"), getattr(self, f"redis_{op}")
        return tier.pages_per_s / base.pages_per_s

    def as_dict(self) -> dict:
        return {"page_bytes": self.page_bytes, "page_size": format_size(self.page_bytes), "pages": self.pages,
                **{f"{side}_{op}": getattr(self, f"{side}_{op}").as_dict() for side in ("tier", "redis")
                   for op in ("put", "get")},
                "ratio_put": self.ratio("put"), "ratio_get": self.ratio("get"),
                "met_put": self.ratio("put") >= TARGET, "met_get": self.ratio("get") >= TARGET}


def default_pages(page_bytes: int, quick: bool) -> int:
    return max(MIN_PAGES, (QUICK_BYTES if quick else DEFAULT_BYTES) // page_bytes)


class _PageBench:
    """One page size on `cluster`: the tier and redis-py over the same keys, engine buffer and sink."""

    def __init__(self, cluster: LocalRedisCluster, page_bytes: int, pages: int, batch: int) -> None:
        from kvtier.mechanism.cluster import ClusterTier, RedisClusterStore

        self.cluster = cluster
        self.pages = pages
        self.batch = batch
        _, layout = layout_for(page_bytes)
        # A generous socket timeout: a timeout is a fault, and a fault is a miss, not a figure.
        self.tier = ClusterTier(RedisClusterStore(cluster.url, timeout=60.0), layout=layout)
        self.client = cluster.client(socket_timeout=60.0)
        self.keys = [i.to_bytes(16, "little") for i in range(pages)]
        self.redis_keys = [self.tier.key(NAMESPACE, k) for k in self.keys]  # the very keys the tier uses
        ring = max(1, min(pages, ENGINE_RING_BYTES // page_bytes))
        self.engine = np.random.default_rng(page_bytes).integers(0, 256, (ring, page_bytes), dtype=np.uint8)
        self.sink = np.zeros_like(self.engine)

    def _page(self, i: int) -> memoryview:
        return memoryview(self.engine[i % len(self.engine)])

    def tier_put(self) -> None:
        for start, n in batches(self.pages, self.batch):
            stored = self.tier.write(NAMESPACE, [(self.keys[i], self._page(i)) for i in range(start, start + n)])
            if stored != n:
                raise RuntimeError(f"the cluster tier stored {stored} of {n} pages: {dict(self.tier.stats().faults)}")

    def tier_get(self) -> None:
        ring = len(self.sink)
        for start, n in batches(self.pages, self.batch):
            ok = self.tier.read(NAMESPACE, self.keys[start:start + n],
                                [memoryview(self.sink[i % ring]) for i in range(start, start + n)])
            if not all(ok):
                raise RuntimeError(f"the cluster tier read {sum(ok)} of {n} pages: {dict(self.tier.stats().faults)}")

    def redis_put(self) -> None:
        for start, n in batches(self.pages, self.batch):
            pipe = self.client.pipeline()
            for i in range(start, start + n):
                pipe.set(self.redis_keys[i], self._page(i))
            pipe.execute()

    def redis_get(self) -> None:
        ring, page_bytes = len(self.sink), self.engine.shape[1]
        for start, n in batches(self.pages, self.batch):
            pipe = self.client.pipeline()
            for i in range(start, start + n):
                pipe.get(self.redis_keys[i])
            for i, data in zip(range(start, start + n), pipe.execute()):
                if data is None or len(data) != page_bytes:
                    raise RuntimeError(f"redis-py got {None if data is None else len(data)} bytes for page {i}")
                np.copyto(self.sink[i % ring], np.frombuffer(data, dtype=np.uint8))

    def round(self, side: str) -> tuple[float, float]:
        """(put seconds, get seconds) of one system on an empty cluster; the bytes checked after."""
        self.cluster.flushall()
        self.sink[...] = 0
        put = timed(getattr(self, f"{side}_put"))
        get = timed(getattr(self, f"{side}_get"))
        verify(self.engine, self.sink, self.pages, f"{side} get")
        return put, get

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.tier.close()
            self.cluster.flushall()


def run_pages(cluster: LocalRedisCluster, page_sizes: Sequence[int], *, pages: int | None, reps: int, batch: int,
              quick: bool, progress: Callable[[str], None]) -> list[PageRow]:
    rows = []
    for size in dict.fromkeys(page_sizes):
        n = pages or default_pages(size, quick)
        bench = _PageBench(cluster, size, n, batch)
        try:
            progress(f"cluster: {format_size(size)} pages: {n} pages, {batch} per pipeline, one untimed round, "
                     f"then {reps} timed")
            bench.round("tier")  # untimed: the first touches of every buffer, on both sides
            bench.round("redis")
            samples: dict[str, list[tuple[float, float]]] = {"tier": [], "redis": []}
            for rep in range(reps):
                for side in (("tier", "redis") if rep % 2 == 0 else ("redis", "tier")):
                    samples[side].append(bench.round(side))
        finally:
            bench.close()
        rate = {(side, op): median_rate(n, size, [s[k] for s in samples[side]])
                for side in samples for k, op in enumerate(("put", "get"))}
        row = PageRow(size, n, rate["tier", "put"], rate["tier", "get"], rate["redis", "put"], rate["redis", "get"])
        progress(f"cluster: {format_size(size)}: tier/redis-py put {row.ratio('put'):.2f}, get {row.ratio('get'):.2f}")
        rows.append(row)
    return rows


# -- part 2: the trace across two daemons ---------------------------------------------------
@dataclass
class NodeHits:
    """One daemon's share of a replay."""

    requests: int = 0
    blocks: int = 0
    hits: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)  # tier label -> blocks hit there
    committed: int = 0  # pages committed (blocks after the hit prefix)
    cluster_written: int = 0  # of those, pages the daemon wrote to the cluster (its stats)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0

    def as_dict(self) -> dict:
        return {"requests": self.requests, "blocks": self.blocks, "hits": self.hits, "hit_rate": self.hit_rate,
                "hits_by_tier": dict(self.by_tier), "committed_pages": self.committed,
                "cluster_written_pages": self.cluster_written}


@dataclass(frozen=True)
class ReplayRun:
    cluster: bool
    nodes: tuple[NodeHits, ...]
    lost: int  # pages a lookup found that were gone by their acquire (counted as hits by the lookup)
    seconds: float

    @property
    def blocks(self) -> int:
        return sum(n.blocks for n in self.nodes)

    @property
    def hits(self) -> int:
        return sum(n.hits for n in self.nodes)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0

    def by_tier(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes:
            for tier, hits in n.by_tier.items():
                out[tier] = out.get(tier, 0) + hits
        return out

    def as_dict(self) -> dict:
        return {"cluster": self.cluster, "blocks": self.blocks, "hits": self.hits, "hit_rate": self.hit_rate,
                "hits_by_tier": self.by_tier(), "lost": self.lost, "seconds": self.seconds,
                "nodes": [n.as_dict() for n in self.nodes]}


def _key(hash_id: int) -> bytes:
    """A trace block id as a block key (16 bytes, the size of the client's default xxh3-128 keys)."""
    return hash_id.to_bytes(16, "little")


def _serve(kv, ids: list[int], hits: NodeHits) -> int:
    """One request through one node's client; returns pages lost between lookup and acquire.
    Every page carries its key in its first bytes, checked when it is acquired: a page read
    from the cluster is the block that was committed, on whichever node."""
    from kvtier_client import NotFound

    keys = [_key(i) for i in ids]
    found = kv.lookup(keys)
    hit = found.hit_blocks
    hits.requests += 1
    hits.blocks += len(keys)
    hits.hits += hit
    for tier in found.tiers[:hit]:
        hits.by_tier[tier.label] = hits.by_tier.get(tier.label, 0) + 1
    lost = 0
    for start, n in batches(hit, LEASE_PAGES):
        try:
            with kv.acquire(keys[start:start + n]) as lease:
                for page, key in zip(lease.pages, keys[start:start + n]):
                    if not _carries(page, key):
                        raise RuntimeError(f"block {key.hex()} came back with another block's bytes")
        except NotFound:  # evicted (or the cluster lost it) between the lookup and the acquire
            lost += hit - start
            break
    for start, n in batches(len(keys) - hit, LEASE_PAGES):
        chunk = keys[hit + start:hit + start + n]
        with kv.borrow(n) as lease:
            for page, key in zip(lease.pages, chunk):
                _tag(page, key)
            lease.commit(chunk, parent=keys[hit + start - 1] if hit + start else None)
        hits.committed += n
    return lost


def _tag(page: np.ndarray, key: bytes) -> None:
    page.reshape(-1)[:len(key)] = np.frombuffer(key, dtype=np.uint8)


def _carries(page: np.ndarray, key: bytes) -> bool:
    return page.reshape(-1)[:len(key)].tobytes() == key


def replay(requests: Sequence[list[int]], workdir: Path, *, cluster_url: str | None, host_pages: int = HOST_PAGES,
           disk_pages: int = DISK_PAGES, progress: Callable[[str], None] = lambda m: None) -> ReplayRun:
    """`requests` round-robin over NODES fresh daemons (with `--cluster cluster_url` if given)."""
    from kvtier_client import KVTierClient, Tier

    slot = TRACE_LAYOUT.slot_bytes
    extra = ["--log-level", "warning"]
    if cluster_url:
        # Pages go to the cluster at commit, through a writer queue as big as the host tier: the
        # replay commits faster than a real engine.
        extra += ["--cluster", cluster_url, "--cluster-write", "commit", "--cluster-queue", str(host_pages * slot),
                  "--cluster-timeout", "5s"]
    daemons: list[ChildDaemon] = []
    clients: list = []
    stats = [NodeHits() for _ in range(NODES)]
    lost = 0
    start = time.perf_counter()
    try:
        for i in range(NODES):
            (workdir / f"node-{i}").mkdir(parents=True)
            daemons.append(ChildDaemon(workdir / f"node-{i}", host_size=host_pages * slot, disk_size=disk_pages * slot,
                                       arena_prefix=f"kvtier-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}", extra=extra))
        for d in daemons:
            d.wait_serving(60.0)
            kv = KVTierClient(d.target)
            clients.append(kv)
            kv.register(NAMESPACE, TRACE_LAYOUT)
        bar = f"cluster trace, {'with' if cluster_url else 'without'} the cluster"
        with progress_bar(progress, bar, len(requests)) as advance:
            for r, ids in enumerate(requests):
                node = r % NODES
                lost += _serve(clients[node], ids, stats[node])
                advance()
                if (r + 1) % 1000 == 0:
                    so_far = sum(s.hits for s in stats) / sum(s.blocks for s in stats)
                    progress(f"cluster: trace, {'with' if cluster_url else 'without'} the cluster: {r + 1:,} of "
                             f"{len(requests):,} requests, hit rate so far {so_far:.4f}")
        if cluster_url:
            for kv, node in zip(clients, stats):
                row = kv.stats().pool(kv.pool.pool_id).tier(Tier.CLUSTER)
                node.cluster_written = row.bytes_in // TRACE_LAYOUT.page_bytes if row else 0
    finally:
        for kv in clients:
            kv.close()
        for d in daemons:
            d.stop()
    return ReplayRun(bool(cluster_url), tuple(stats), lost, time.perf_counter() - start)


def load_requests(path: str | os.PathLike, limit: int | None) -> list[list[int]]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{absent(path)}, or pass --trace")
    out = []
    for ids in read_trace(str(path)):
        if limit is not None and len(out) >= limit:
            break
        out.append(ids)
    return out


# -- the whole run ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterResult:
    date: str
    machine: dict
    server: str | None
    masters: int
    batch: int
    reps: int
    pages: tuple[PageRow, ...]
    trace: str | None
    requests: int
    infinite: float | None  # the trace's requests through one cache that never evicts
    runs: tuple[ReplayRun, ...]  # without the cluster, with it
    host_pages: int
    disk_pages: int
    seconds: float

    def as_dict(self) -> dict:
        return {
            "date": self.date, "machine": self.machine, "server": self.server, "masters": self.masters,
            "batch": self.batch, "reps": self.reps, "target": TARGET, "pages": [r.as_dict() for r in self.pages],
            "trace": {"path": self.trace, "requests": self.requests, "infinite": self.infinite,
                      "nodes": NODES, "host_pages": self.host_pages, "disk_pages": self.disk_pages,
                      "page_bytes": TRACE_LAYOUT.page_bytes, "runs": [r.as_dict() for r in self.runs]},
            "seconds": self.seconds,
        }


def run_cluster(
    page_sizes: Sequence[int] = PAGE_SIZES,
    *,
    pages: int | None = None,
    reps: int | None = None,
    batch: int = BATCH,
    quick: bool = False,
    trace: str | os.PathLike | None = DEFAULT_TRACE,
    requests: int | None = TRACE_REQUESTS,
    host_pages: int = HOST_PAGES,
    disk_pages: int = DISK_PAGES,
    directory: str | None = None,
    progress: Callable[[str], None] = lambda message: None,
) -> ClusterResult:
    """Both parts on one loopback cluster of MASTERS masters: `page_sizes` empty skips the
    pages part, `trace` None the trace part; `requests` None replays the whole trace."""
    reps = reps if reps is not None else (QUICK_REPS if quick else DEFAULT_REPS)
    if reps <= 0 or batch <= 0 or (pages is not None and pages <= 0) or (requests is not None and requests < NODES):
        raise ValueError(f"pages, reps and batch must be positive and requests at least {NODES}")
    if host_pages < 2 * LEASE_PAGES or disk_pages < 0:
        raise ValueError(f"host_pages must be at least {2 * LEASE_PAGES} (a lease of {LEASE_PAGES} and room to spare)")
    trace_requests = load_requests(trace, requests) if trace is not None else []
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-cluster-", dir=bench_dir(directory)))
    try:
        progress(f"cluster: starting a loopback Redis Cluster of {MASTERS} masters")
        with LocalRedisCluster.start(root / "redis", masters=MASTERS) as cluster:
            rows = run_pages(cluster, page_sizes, pages=pages, reps=reps, batch=batch, quick=quick, progress=progress)
            runs = []
            if trace_requests:
                for url in (None, cluster.url):
                    progress(f"cluster: trace, {len(trace_requests):,} requests over {NODES} daemons, "
                             f"{'with' if url else 'without'} the cluster tier")
                    run = replay(trace_requests, root / ("with" if url else "without"), cluster_url=url,
                                 host_pages=host_pages, disk_pages=disk_pages, progress=progress)
                    progress(f"cluster: trace {'with' if url else 'without'} the cluster: hit rate {run.hit_rate:.4f} "
                             f"in {run.seconds:.0f} s")
                    runs.append(run)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    infinite = None
    if trace_requests:
        hit, looked_up = infinite_hits(trace_requests)
        infinite = hit / looked_up if looked_up else 0.0
    return ClusterResult(utc_now(), machine_description(directory), redis_version(), MASTERS, batch, reps, tuple(rows),
                         shown(trace) if trace is not None else None, len(trace_requests), infinite, tuple(runs),
                         host_pages, disk_pages, time.perf_counter() - t0)


# -- output -------------------------------------------------------------------------------------
def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]


def _page_rows(result: ClusterResult) -> list[list[str]]:
    rows = [["page", "pages", "tier put GB/s", "redis-py put GB/s", "put ratio", "tier get GB/s", "redis-py get GB/s",
             "get ratio"]]
    for r in result.pages:
        rows.append([format_size(r.page_bytes), str(r.pages), f"{r.tier_put.gb_per_s:.2f}",
                     f"{r.redis_put.gb_per_s:.2f}", f"{r.ratio('put'):.2f}", f"{r.tier_get.gb_per_s:.2f}",
                     f"{r.redis_get.gb_per_s:.2f}", f"{r.ratio('get'):.2f}"])
    return rows


def _trace_rows(result: ClusterResult) -> list[list[str]]:
    rows = [["cluster tier", "hit rate", *(f"node {i}" for i in range(NODES)), "host hits", "disk hits", "cluster hits",
             "blocks"]]
    for run in result.runs:
        tiers = run.by_tier()
        rows.append(["with" if run.cluster else "without", f"{run.hit_rate:.4f}",
                     *(f"{n.hit_rate:.4f}" for n in run.nodes),
                     *(f"{tiers.get(t, 0):,}" for t in ("host", "disk", "cluster")), f"{run.blocks:,}"])
    return rows


def _notes(result: ClusterResult) -> list[str]:
    lines = []
    if result.pages:
        lines.append(f"pages: {result.batch} pages per pipeline (one batch per node), median of {result.reps} after "
                     f"one untimed round; ratio = tier / redis-py, target >= {TARGET}; tier = ClusterTier.write/read "
                     "(header + xxh3 checksum, verified, copied into the buffer)")
    if result.runs:
        lines.append(f"trace: {result.requests:,} requests of {result.trace}, round-robin over {NODES} daemons, each "
                     f"with {result.host_pages:,} host + {result.disk_pages:,} disk pages of "
                     f"{format_size(TRACE_LAYOUT.page_bytes)}; hit rate = blocks hit / blocks looked up; "
                     f"one cache that never evicts: {result.infinite:.4f}")
        lost = sum(r.lost for r in result.runs)
        written = [(n.cluster_written, n.committed) for r in result.runs if r.cluster for n in r.nodes]
        if written:
            lines.append("pages written to the cluster / committed: "
                         + ", ".join(f"node {i} {w:,} / {c:,}" for i, (w, c) in enumerate(written))
                         + (f"; {lost} hit pages were gone by their acquire" if lost else ""))
    return lines


def format_table(result: ClusterResult) -> str:
    lines = [f"kvtier bench cluster, {result.date}: {result.masters}-master loopback cluster ({result.server})",
             describe_machine(result.machine), ""]
    if result.pages:
        lines += _table(_page_rows(result)) + [""]
    if result.runs:
        lines += _table(_trace_rows(result)) + [""]
    return "\n".join(lines + _notes(result))


def format_markdown(result: ClusterResult) -> str:
    lines = []
    for rows in (_page_rows(result) if result.pages else None, _trace_rows(result) if result.runs else None):
        if rows:
            lines += ["| " + " | ".join(rows[0]) + " |", "|---|" + "---:|" * (len(rows[0]) - 1)]
            lines += ["| " + " | ".join(r) + " |" for r in rows[1:]] + [""]
    return "\n".join(lines + _notes(result))


def server_missing() -> str | None:
    """Why the cluster benchmark cannot run here, or None."""
    from kvtier_bench.peers.redis import redis_server_binary

    return None if redis_server_binary() else f"no redis-server or valkey-server found: {SETUP_HINT}"
