"""`kvtier bench node`: what one node-wide daemon (one kvtier serving every engine of a node)
buys over one daemon per engine, with the same memory, on the Mooncake conversation trace.

Four engines on one node, each a client process of its own (kvtier_bench.node_engine: lookup,
acquire + release of the cached prefix, borrow + write + commit of the rest). The trace's
requests, in time order, go to the engines through a router; each engine serves one request
at a time and the router hands request i to its engine once that engine's previous request is
answered, so at most one request per engine is in flight and the engines run side by side,
interleaved as they come. Setups, each on fresh daemons:

    shared          one daemon, all four engines in one namespace, a host tier of 4 x C pages
                    (and a disk tier of 4 x D); round-robin routing (request i -> engine i mod 4)
    private         four daemons, one per engine, each C host pages (and D disk); round-robin
    private-sticky  the four private daemons behind a prefix-affinity router instead (what a
                    KV-aware router recovers without sharing; see PrefixAffinity)

C is a fraction of the trace's distinct blocks over 4: the shared daemon holds that fraction
of them. Block hit rate is the trace README's: per request, the leading blocks cached at
arrival (the daemon's lookup, less any evicted before their acquire) over the blocks looked
up. Prefill tokens saved = blocks hit x 512. Hit counts come from the daemons' answers and
are checked against each daemon's own counters (its pools' lookup_blocks - miss_blocks).
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier_bench.clients import Worker as _PipeWorker
from kvtier_bench.harness import (
    bench_dir,
    machine_description,
    progress_bar,
    utc_now,
)
from kvtier_bench.internals import TRACE_BLOCK_TOKENS, ChildDaemon, read_timed_trace
from kvtier_bench.node_engine import LAYOUT, LEASE_PAGES
from kvtier_bench.node_routing import make_router
from kvtier_bench.shared_data import absent, shown
from kvtier_bench.trace import DEFAULT_TRACE, infinite_hits

ENGINES = 4
NAMESPACE = "node"
#: The shared daemon's host tier holds these fractions of the trace's distinct blocks.
FRACTIONS = (0.10, 0.25, 0.50)
#: A private daemon's host tier is never smaller than this: a read lease and a write lease of
#: LEASE_PAGES each, with room to spare.
MIN_PAGES = 2 * LEASE_PAGES


@dataclass(frozen=True)
class Setup:
    name: str
    daemons: int  # 1: one node-wide daemon for every engine; ENGINES: one per engine
    routing: str  # a ROUTERS name


SETUPS = (Setup("shared", 1, "round-robin"), Setup("private", ENGINES, "round-robin"),
          Setup("private-sticky", ENGINES, "prefix-affinity"))
SETUP_NAMES = tuple(s.name for s in SETUPS)


@dataclass
class EngineCounts:
    """One engine's share of a run, summed from its answers."""

    requests: int = 0
    blocks: int = 0
    hits: int = 0
    lost: int = 0  # found by the lookup, evicted before their acquire (not counted as hits)
    committed: int = 0
    duplicates: int = 0  # committed by another engine of the same daemon in the meantime

    def add(self, answer: dict) -> None:
        self.requests += 1
        for name in ("blocks", "hits", "lost", "committed", "duplicates"):
            setattr(self, name, getattr(self, name) + answer[name])

    @property
    def hit_rate(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0


@dataclass(frozen=True)
class Run:
    """One setup at one capacity."""

    setup: str
    routing: str
    daemons: int
    host_pages: int  # per daemon
    disk_pages: int  # per daemon
    engines: tuple[EngineCounts, ...]
    hits_by_tier: dict[str, int]
    daemon_hits: int  # the daemons' own count: lookup_blocks - miss_blocks over their pools
    daemon_lookups: int
    seconds: float  # first request sent to last answer in
    ceiling: float  # the hit rate of the same routing with caches that never evict

    @property
    def blocks(self) -> int:
        return sum(e.blocks for e in self.engines)

    @property
    def hits(self) -> int:
        return sum(e.hits for e in self.engines)

    @property
    def lost(self) -> int:
        return sum(e.lost for e in self.engines)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0

    @property
    def tokens_saved(self) -> int:
        return self.hits * TRACE_BLOCK_TOKENS

    def as_dict(self) -> dict:
        return {"setup": self.setup, "routing": self.routing, "daemons": self.daemons, "host_pages": self.host_pages,
                "disk_pages": self.disk_pages, "total_pages": self.daemons * (self.host_pages + self.disk_pages),
                "blocks": self.blocks, "hits": self.hits, "hit_rate": self.hit_rate, "lost": self.lost,
                "prefill_tokens_saved": self.tokens_saved, "hits_by_tier": dict(self.hits_by_tier),
                "daemon_hits": self.daemon_hits, "daemon_lookups": self.daemon_lookups, "seconds": self.seconds,
                "requests_per_s": sum(e.requests for e in self.engines) / self.seconds if self.seconds else None,
                "ceiling": self.ceiling,
                "engines": [vars(e) | {"hit_rate": e.hit_rate} for e in self.engines]}


# -- one run ---------------------------------------------------------------------------------
class _Engine(_PipeWorker):
    """One engine process (kvtier_bench.node_engine) and its command pipe."""

    def __init__(self, target: str, index: int, log: Path) -> None:
        self.index = index
        self.log = open(log, "wb")  # noqa: SIM115 - the engine's stderr while it lives; closed by stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier_bench.node_engine", "--target", target, "--namespace", NAMESPACE,
             "--index", str(index)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()


def _daemon_counts(targets: Sequence[str]) -> tuple[int, int]:
    """(hit blocks, looked-up blocks) as the daemons count them, over every pool of each."""
    from kvtier_client import KVTierClient

    hits = lookups = 0
    for target in targets:
        kv = KVTierClient(target, name="bench-node-stats")
        try:
            for pool in kv.stats().pools:
                hits += pool.lookup_blocks - pool.miss_blocks
                lookups += pool.lookup_blocks
        finally:
            kv.close()
    return hits, lookups


def replay(requests: Sequence[list[int]], setup: Setup, workdir: Path, *, host_pages: int, disk_pages: int = 0,
           policy: str | None = None, progress: Callable[[str], None] = lambda message: None) -> Run:
    """`requests` through ENGINES engine processes on `setup.daemons` fresh daemons of
    `host_pages` (+ `disk_pages`) pages each."""
    slot = LAYOUT.slot_bytes
    extra = ["--log-level", "warning", *(("--policy", policy) if policy else ())]
    daemons: list[ChildDaemon] = []
    engines: list[_Engine] = []
    counts = [EngineCounts() for _ in range(ENGINES)]
    tiers: dict[str, int] = {}
    router = make_router(setup.routing, ENGINES)
    try:
        for d in range(setup.daemons):
            (workdir / f"daemon-{d}").mkdir(parents=True)
            daemons.append(ChildDaemon(workdir / f"daemon-{d}", host_size=host_pages * slot,
                                       disk_size=disk_pages * slot,
                                       arena_prefix=f"kvtier-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}", extra=extra))
        for d in daemons:
            d.wait_serving(60.0)
        engines = [_Engine(daemons[e % len(daemons)].target, e, workdir / f"engine-{e}.log") for e in range(ENGINES)]
        for engine in engines:
            if engine.receive(120).get("transport") != "lane":
                raise RuntimeError(f"engine {engine.index} does not use the fast lane")

        def collect(e: int) -> None:
            answer = engines[e].receive(300)
            counts[e].add(answer)
            for tier, n in answer["tiers"].items():
                tiers[tier] = tiers.get(tier, 0) + n

        busy = [False] * ENGINES
        start = time.perf_counter()
        with progress_bar(progress, f"node {setup.name}, {host_pages:,} host pages per daemon", len(requests)) as advance:
            for ids in requests:
                e = router.route(ids)
                if busy[e]:
                    collect(e)
                    advance()
                engines[e].send("R " + json.dumps(ids))
                busy[e] = True
            for e in range(ENGINES):
                if busy[e]:
                    collect(e)
                    advance()
        seconds = time.perf_counter() - start
        daemon_hits, daemon_lookups = _daemon_counts([d.target for d in daemons])
    except RuntimeError as exc:  # an engine failed: what its daemon said is most often why
        logs = "\n".join(f"daemon {i}'s log ends: {d.log_tail(5)}" for i, d in enumerate(daemons))
        raise RuntimeError(f"{exc}\n{logs}") from exc
    finally:
        for engine in engines:
            engine.stop()
        for d in daemons:
            d.stop()
    return Run(setup.name, setup.routing, setup.daemons, host_pages, disk_pages, tuple(counts), tiers, daemon_hits,
               daemon_lookups, seconds, ceiling(requests, setup))


def ceiling(requests: Sequence[list[int]], setup: Setup) -> float:
    """The hit rate `setup` would reach if no cache ever evicted: what its routing allows.
    The shared daemon's is one cache that never evicts; private daemons' is each engine's
    requests through its own such cache."""
    if setup.daemons == 1:
        hits, blocks = infinite_hits(requests)
        return hits / blocks if blocks else 0.0
    router = make_router(setup.routing, ENGINES)
    per_engine: list[list[list[int]]] = [[] for _ in range(ENGINES)]
    for ids in requests:
        per_engine[router.route(ids)].append(ids)
    counts = [infinite_hits(mine) for mine in per_engine]
    blocks = sum(b for _, b in counts)
    return sum(h for h, _ in counts) / blocks if blocks else 0.0


# -- the sweep -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Point:
    """One capacity: every setup's run with the same total memory."""

    fraction: float
    shared_host_pages: int
    shared_disk_pages: int
    runs: tuple[Run, ...]

    def run(self, setup: str) -> Run | None:
        return next((r for r in self.runs if r.setup == setup), None)

    def ratio(self, setup: str, over: str = "private") -> float | None:
        a, b = self.run(setup), self.run(over)
        return a.hit_rate / b.hit_rate if a and b and b.hit_rate else None


@dataclass(frozen=True)
class NodeResult:
    date: str
    machine: dict
    trace: str
    requests: int
    blocks: int
    distinct_blocks: int
    infinite: float  # one cache that never evicts, fed the same requests in order
    policy: str | None
    disk_factor: int
    points: tuple[Point, ...]
    seconds: float

    def as_dict(self) -> dict:
        return {
            "date": self.date, "machine": self.machine, "trace": self.trace, "requests": self.requests,
            "blocks": self.blocks, "distinct_blocks": self.distinct_blocks, "infinite": self.infinite,
            "engines": ENGINES, "block_tokens": TRACE_BLOCK_TOKENS, "page_bytes": LAYOUT.page_bytes,
            "policy": self.policy or "the daemon's default", "disk_factor": self.disk_factor,
            "points": [{"fraction": p.fraction, "shared_host_pages": p.shared_host_pages,
                        "shared_disk_pages": p.shared_disk_pages,
                        "shared_over_private": p.ratio("shared"),
                        "sticky_over_private": p.ratio("private-sticky"),
                        "runs": [r.as_dict() for r in p.runs]} for p in self.points],
            "seconds": self.seconds,
        }


def load_requests(path: str | os.PathLike, limit: int | None = None) -> list[list[int]]:
    """The trace's requests in time order (a stable sort by timestamp), the first `limit`."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{absent(path)}, or pass --trace")
    timed = sorted(read_timed_trace(str(path)), key=lambda request: request[0])
    return [ids for _, ids in timed[:limit]]


def run_node(
    trace: str | os.PathLike = DEFAULT_TRACE,
    *,
    requests: int | None = None,
    fractions: Sequence[float] = FRACTIONS,
    disk_factor: int = 0,
    setups: Sequence[str] = SETUP_NAMES,
    policy: str | None = None,
    directory: str | None = None,
    progress: Callable[[str], None] = lambda message: None,
) -> NodeResult:
    """Every setup at every capacity on the trace's first `requests` (None: all of them)."""
    unknown = [s for s in setups if s not in SETUP_NAMES]
    if unknown or not fractions or any(not 0 < f <= 1 for f in fractions) or disk_factor < 0:
        raise ValueError(f"setups must be among {', '.join(SETUP_NAMES)}, fractions in (0, 1] and disk_factor >= 0")
    chosen = [s for s in SETUPS if s.name in setups]
    t0 = time.perf_counter()
    trace_requests = load_requests(trace, requests)
    if len(trace_requests) < ENGINES:
        raise ValueError(f"{trace} has {len(trace_requests)} requests: at least {ENGINES} are needed")
    distinct = len({block for ids in trace_requests for block in ids})
    hit, looked_up = infinite_hits(trace_requests)
    progress(f"node: {len(trace_requests):,} requests, {looked_up:,} blocks, {distinct:,} distinct; "
             f"one cache that never evicts hits {hit / looked_up:.4f}")
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-node-", dir=bench_dir(directory)))
    points = []
    try:
        for fraction in fractions:
            private = max(MIN_PAGES, round(fraction * distinct / ENGINES))
            runs = []
            for setup in chosen:
                per_daemon = private * ENGINES // setup.daemons  # the same total for every setup
                run = replay(trace_requests, setup, root / f"{fraction}-{setup.name}", host_pages=per_daemon,
                             disk_pages=per_daemon * disk_factor, policy=policy, progress=progress)
                progress(f"node: {fraction:.0%} of the distinct blocks, {setup.name}: hit rate {run.hit_rate:.4f} "
                         f"in {run.seconds:.0f} s")
                runs.append(run)
            points.append(Point(fraction, private * ENGINES, private * ENGINES * disk_factor, tuple(runs)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return NodeResult(utc_now(), machine_description(directory), shown(trace), len(trace_requests), looked_up, distinct,
                      hit / looked_up if looked_up else 0.0, policy, disk_factor, tuple(points),
                      time.perf_counter() - t0)
