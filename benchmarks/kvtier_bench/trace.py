"""Trace benchmark: block hit rate against cache capacity on the Mooncake conversation trace.

For each capacity (host pages of 512 tokens) and each policy (`lru`, `prefix`), the trace
is replayed through a real BlockStore (kvtier.replay.mooncake.replay) with one tier, and
with a disk tier of DISK_FACTOR times the host tier behind it (write-back). Two reference
lines come from the trace alone:

- infinite capacity: every block ever seen stays cached (the most any cache can hit);
- offline farthest-next-use (Belady) with one tier of the same capacity: on a miss with a
  full cache, evict the cached block whose next use lies farthest in the future. It knows
  the future, it is not prefix-aware, and every missed block is inserted (demand caching,
  no bypass), as in the trace's README.

The hit rate is the trace README's: per request, the number of leading blocks cached at
arrival, over all blocks looked up; blocks are inserted or touched after the lookup, in
request order. Figures are exact counts, not timings, so the replays run in parallel.
"""
from __future__ import annotations

import heapq
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvtier_bench.harness import progress_bar, utc_now
from kvtier_bench.internals import TRACE_BLOCK_TOKENS, PolicyName, read_trace, replay

#: Where every developer machine and CI have the trace (never copied into the repository).
DEFAULT_TRACE = Path(os.environ.get("KVTIER_MOONCAKE_TRACE", "/work/shared/data/mooncake/conversation_trace.jsonl"))
POLICIES = tuple(p.value for p in PolicyName)
#: The disk tier of the host+disk lines holds this many times the host tier's pages.
DISK_FACTOR = 10
#: Host capacities in 512-token pages: 0.5M, 1M, 2M, 3M, 5M, 10M and 20M tokens.
CAPACITIES = (977, 1953, 3906, 5859, 9766, 19531, 39062)
QUICK_CAPACITIES = (1953, 5859, 19531)
INFINITE = float("inf")


def flatten(requests: Sequence[Sequence[int]]) -> list[int]:
    return [block for request in requests for block in request]


def next_uses(accesses: Sequence[int]) -> list[int]:
    """For each position, the next position at which the same block is accessed (len(accesses) if never)."""
    never = len(accesses)
    nxt = [never] * never
    last: dict[int, int] = {}
    for pos in range(never - 1, -1, -1):
        block = accesses[pos]
        nxt[pos] = last.get(block, never)
        last[block] = pos
    return nxt


def infinite_hits(requests: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(hit blocks, looked-up blocks) with a cache that never evicts."""
    seen: set[int] = set()
    hits = blocks = 0
    for request in requests:
        blocks += len(request)
        for block in request:
            if block not in seen:
                break
            hits += 1
        seen.update(request)
    return hits, blocks


def belady_hits(requests: Sequence[Sequence[int]], capacity: int) -> tuple[int, int]:
    """(hit blocks, looked-up blocks) for one tier of `capacity` blocks managed by offline
    farthest-next-use eviction, every missed block inserted.

    Next uses are precomputed over the flattened access sequence; the cache is a dict
    block -> its next use, and a max-heap of (next use, block) entries with lazy deletion:
    a touch pushes a fresh entry, and a popped entry whose next use no longer matches the
    dict is stale and skipped. O(N log N) for N accesses.
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    accesses = flatten(requests)
    nxt = next_uses(accesses)
    cached: dict[int, int] = {}
    heap: list[tuple[int, int]] = []  # (-next use, block)
    hits = 0
    pos = 0
    for request in requests:
        for block in request:  # the lookup: leading blocks cached at arrival
            if block not in cached:
                break
            hits += 1
        for block in request:
            use = nxt[pos]
            pos += 1
            if block not in cached and len(cached) >= capacity:
                while True:
                    neg, victim = heapq.heappop(heap)
                    if cached.get(victim) == -neg:
                        del cached[victim]
                        break
            cached[block] = use
            heapq.heappush(heap, (-use, block))
        if len(heap) > 4 * capacity + 1024:  # drop stale entries now and then
            heap = [(-use, block) for block, use in cached.items()]
            heapq.heapify(heap)
    return hits, len(accesses)


@dataclass(frozen=True)
class Point:
    """One capacity: hit rates of every line (None where not computed)."""

    host_pages: int
    disk_pages: int
    rates: dict[str, float]  # series name -> block hit rate
    tier_rates: dict[str, dict[str, float]]  # host+disk series -> {"host": ..., "disk": ...}

    @property
    def host_tokens(self) -> int:
        return self.host_pages * TRACE_BLOCK_TOKENS


@dataclass(frozen=True)
class TraceResult:
    date: str
    trace: str
    requests: int
    blocks: int
    infinite: float
    disk_factor: int
    points: tuple[Point, ...]
    seconds: float

    @property
    def series(self) -> list[str]:
        names: list[str] = []
        for p in self.points:
            names += [n for n in p.rates if n not in names]
        return names

    def as_dict(self) -> dict:
        return {
            "date": self.date,
            "trace": self.trace,
            "requests": self.requests,
            "blocks": self.blocks,
            "block_tokens": TRACE_BLOCK_TOKENS,
            "infinite": self.infinite,
            "disk_factor": self.disk_factor,
            "seconds": self.seconds,
            "points": [
                {"host_pages": p.host_pages, "host_tokens": p.host_tokens, "disk_pages": p.disk_pages,
                 "hit_rate": p.rates, "tier_hit_rate": p.tier_rates}
                for p in self.points
            ],
        }


def _series_name(policy: str, disk: bool) -> str:
    return f"{policy} host+disk" if disk else policy


def _replay_job(job: tuple[str, int | None, int, int, str]) -> tuple[int, int, str, float, float, float]:
    path, limit, host, disk, policy = job
    requests = _load(path, limit)
    r = replay(requests, host_pages=host, disk_pages=disk, policy=policy)
    d = r.as_dict()
    return host, disk, policy, r.block_hit_rate, d["tier_hit_rates"]["host"], d["tier_hit_rates"]["disk"]


def _load(path: str, limit: int | None) -> list[list[int]]:
    requests = []
    for i, ids in enumerate(read_trace(path)):
        if limit is not None and i >= limit:
            break
        requests.append(ids)
    return requests


def run_trace(
    trace: str | os.PathLike = DEFAULT_TRACE,
    *,
    capacities: Sequence[int] | None = None,
    quick: bool = False,
    policies: Sequence[str] = POLICIES,
    disk_factor: int = DISK_FACTOR,
    limit: int | None = None,
    workers: int | None = None,
    progress: Callable[[str], None] = lambda message: None,
) -> TraceResult:
    """Hit rate against capacity; `limit` replays only the first requests (tests)."""
    import time

    path = str(trace)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is absent: the Mooncake conversation trace is needed (see shared/data/mooncake/README.md)")
    capacities = tuple(capacities or (QUICK_CAPACITIES if quick else CAPACITIES))
    if any(c <= 0 for c in capacities) or disk_factor < 0:
        raise ValueError("capacities must be positive and disk_factor non-negative")
    start = time.perf_counter()
    requests = _load(path, limit)
    hits, blocks = infinite_hits(requests)
    infinite = hits / blocks if blocks else 0.0
    progress(f"trace: {len(requests):,} requests, {blocks:,} blocks, infinite-cache hit rate {infinite:.4f}")
    rates: dict[int, dict[str, float]] = {c: {} for c in capacities}
    tiers: dict[int, dict[str, dict[str, float]]] = {c: {} for c in capacities}
    for c in capacities:
        h, b = belady_hits(requests, c)
        rates[c]["belady"] = h / b if b else 0.0
        progress(f"trace: Belady, {c:,} pages: {rates[c]['belady']:.4f}")
    jobs = [(path, limit, c, disk, policy) for c in capacities for disk in ((0, c * disk_factor) if disk_factor else (0,))
            for policy in policies]
    workers = workers or max(1, min(2, os.cpu_count() or 1))
    done = 0

    def record(result: tuple[int, int, str, float, float, float]) -> None:
        nonlocal done
        host, disk, policy, rate, host_rate, disk_rate = result
        name = _series_name(policy, disk > 0)
        rates[host][name] = rate
        if disk:
            tiers[host][name] = {"host": host_rate, "disk": disk_rate}
        done += 1
        advance()
        progress(f"trace: {done} of {len(jobs)} replays: {name}, {host:,} host pages: {rate:.4f}")

    with progress_bar(progress, "trace replays", len(jobs)) as advance:
        if workers > 1 and len(jobs) > 1:
            with ProcessPoolExecutor(max_workers=workers) as pool:
                for result in pool.map(_replay_job, jobs):
                    record(result)
        else:
            for job in jobs:
                record(_replay_job(job))
    order = [*(_series_name(p, False) for p in policies), *(_series_name(p, True) for p in policies if disk_factor),
             "belady"]
    points = tuple(
        Point(c, c * disk_factor, {n: rates[c][n] for n in order if n in rates[c]}, tiers[c]) for c in capacities
    )
    return TraceResult(
        date=utc_now(),
        trace=path,
        requests=len(requests),
        blocks=blocks,
        infinite=infinite,
        disk_factor=disk_factor,
        points=points,
        seconds=time.perf_counter() - start,
    )


def _tokens(pages: int) -> str:
    tokens = pages * TRACE_BLOCK_TOKENS
    return f"{tokens / 1e6:.1f}M"


def format_table(result: TraceResult) -> str:
    series = result.series
    header = ["host pages", "tokens", *series]
    rows = [header]
    for p in result.points:
        rows.append([f"{p.host_pages:,}", _tokens(p.host_pages), *(f"{p.rates[s]:.4f}" if s in p.rates else "-" for s in series)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        f"kvtier bench trace, {result.date}: {result.trace}",
        (f"{result.requests:,} requests, {result.blocks:,} blocks of {TRACE_BLOCK_TOKENS} tokens; block hit rate "
         f"(leading cached blocks / blocks looked up); host+disk: a disk tier of {result.disk_factor}x the host pages"),
        "",
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines += ["", f"infinite capacity: {result.infinite:.4f}; belady: offline farthest-next-use, one tier, not prefix-aware"]
    return "\n".join(lines)


def format_markdown(result: TraceResult) -> str:
    series = result.series
    lines = ["| host pages (tokens) | " + " | ".join(series) + " |", "|---|" + "---:|" * len(series)]
    for p in result.points:
        lines.append(f"| {p.host_pages:,} ({_tokens(p.host_pages)}) | "
                     + " | ".join(f"{p.rates[s]:.4f}" if s in p.rates else "-" for s in series) + " |")
    lines += ["", (f"Infinite capacity: {result.infinite:.4f}. Belady: offline farthest-next-use, one tier, not "
                   f"prefix-aware. host+disk: a disk tier of {result.disk_factor}x the host pages behind it (write-back).")]
    return "\n".join(lines)


def plot(result: TraceResult, path: str | os.PathLike) -> None:
    """Hit rate against host capacity (tokens, log scale), one line per series, the infinite cache dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    xs = [p.host_tokens for p in result.points]
    colours = {"lru": "tab:blue", "prefix": "tab:orange"}
    markers = {"lru": "o", "prefix": "s"}
    for name in result.series:
        ys = [p.rates.get(name) for p in result.points]
        if name == "belady":
            ax.plot(xs, ys, linestyle=":", marker="^", color="black", label="Belady (offline, one tier)")
            continue
        policy = name.split()[0]
        ax.plot(xs, ys, color=colours.get(policy), marker=markers.get(policy, "o"), markersize=5,
                linestyle="--" if "disk" in name else "-", label=name.replace("host+disk", f"host + {result.disk_factor}x disk"))
    ax.axhline(result.infinite, color="grey", linestyle="--", linewidth=1, label=f"infinite ({result.infinite:.3f})")
    ax.set_xscale("log")
    ax.set_xticks(xs, [_tokens(p.host_pages) for p in result.points])
    ax.minorticks_off()
    ax.set_xlabel(f"host tier capacity, tokens (host+disk: disk = {result.disk_factor}x host)")
    ax.set_ylabel("block hit rate")
    ax.set_title("Mooncake conversation trace: hit rate vs capacity")
    ax.set_ylim(0, max(0.05, result.infinite * 1.15))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
