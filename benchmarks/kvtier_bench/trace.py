"""Trace benchmark: block hit rate against cache capacity, per policy, on the Mooncake
conversation trace and on synthetic traces of known shapes (kvtier_bench.shapes).

Shapes: `mooncake` (the real trace), `mooncake-2nd-half` (the same, the first half by time
only warming the cache: a policy tuned on the first half is judged on the second) and the
synthetic ones. For each shape, capacity (host pages of 512 tokens) and policy (every
built-in policy unless told), the requests are replayed with one tier through the policy alone
(kvtier.replay.policy: the same figures as a store, several times faster), and with a disk
tier of DISK_FACTOR times the host tier behind it through a real BlockStore
(kvtier.replay.mooncake.replay; write-back; with `admissions`, once per disk admission). Three
reference lines come from the requests alone:

- infinite capacity: every block ever seen stays cached (the most any cache can hit);
- offline farthest-next-use (Belady) with one tier of the host's capacity, and
  `belady host+disk` with one tier of host + disk pages (a bound for the two tiers): it
  knows the future, it is not prefix-aware, and every missed block is inserted (demand
  caching, no bypass), as in the trace's README.

The hit rate is the trace README's: per request, the number of leading blocks cached at
arrival, over all blocks looked up; blocks are inserted or touched after the lookup, in
request order. `x lru` is a series' hit rate over lru's at the same capacity and tiers.
Figures are exact counts, not timings (but the policies' own speed), so the replays run
in parallel.
"""
from __future__ import annotations

import functools
import heapq
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvtier_bench import shapes
from kvtier_bench.harness import progress_bar, utc_now
from kvtier_bench.shared_data import absent, mooncake_trace, shown
from kvtier_bench.internals import (CODECS, DEFAULT_LAYOUT, TRACE_BLOCK_TOKENS, CodecRatio, POLICY_REGISTRY, describe, halfway,
                                   measure_ratio, read_timed_trace, replay, replay_policy)

#: The shared Mooncake trace, beside the clone or under $KVTIER_SHARED_DATA (kvtier_bench.shared_data).
DEFAULT_TRACE = mooncake_trace()
POLICIES = POLICY_REGISTRY.builtin
#: The reference every series is divided by in `x lru`.
REFERENCE = "lru"
BELADY = "belady"
MOONCAKE = "mooncake"
MOONCAKE_2ND_HALF = "mooncake-2nd-half"
SHAPES = (MOONCAKE, MOONCAKE_2ND_HALF, *shapes.SHAPES)
#: The disk tier of the host+disk lines holds this many times the host tier's pages.
DISK_FACTOR = 10
#: Host capacities in 512-token pages: 0.5M, 1M, 2M, 3M, 5M, 10M, 20M and 30M tokens.
CAPACITIES = (977, 1953, 3906, 5859, 9766, 19531, 39062, 58594)
QUICK_CAPACITIES = (1953, 5859, 19531)
INFINITE = float("inf")


def _checked(policy: str) -> str:
    """`policy` if it names one (kvtier.policy.POLICIES); RegistryError (a ValueError) if not."""
    POLICY_REGISTRY[policy]
    return policy


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


def _cached_prefix(request: Sequence[int], cached) -> int:
    """How many leading blocks of `request` are in `cached`: the request's hits."""
    hits = 0
    for block in request:
        if block not in cached:
            break
        hits += 1
    return hits


def infinite_hits(requests: Sequence[Sequence[int]], measure_from: int = 0) -> tuple[int, int]:
    """(hit blocks, looked-up blocks) with a cache that never evicts, counting the
    requests from index `measure_from` on."""
    seen: set[int] = set()
    hits = blocks = 0
    for i, request in enumerate(requests):
        if i >= measure_from:
            blocks += len(request)
            hits += _cached_prefix(request, seen)
        seen.update(request)
    return hits, blocks


def belady_hits(requests: Sequence[Sequence[int]], capacity: int, measure_from: int = 0) -> tuple[int, int]:
    """(hit blocks, looked-up blocks) for one tier of `capacity` blocks managed by offline
    farthest-next-use eviction, every missed block inserted, counting the requests from
    index `measure_from` on.

    Next uses are precomputed over the flattened access sequence; the cache is a dict
    block -> its next use, and a max-heap of (next use, block) entries with lazy deletion:
    a touch pushes a fresh entry, and a popped entry whose next use no longer matches the
    dict is stale and skipped. O(N log N) for N accesses.
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    nxt = next_uses(flatten(requests))
    cached: dict[int, int] = {}
    heap: list[tuple[int, int]] = []  # (-next use, block)
    hits = blocks = 0
    pos = 0
    for i, request in enumerate(requests):
        if i >= measure_from:
            blocks += len(request)
            hits += _cached_prefix(request, cached)
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
    return hits, blocks


# -- where the requests come from ---------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """One shape's requests: the Mooncake trace at `path` (its first `limit` requests), or
    a synthetic shape of `scale` and `seed`. Small and picklable: each replay job loads it
    in its worker, which keeps the last ones loaded."""

    shape: str
    path: str
    limit: int | None = None
    seed: int = 0
    scale: float = 1.0

    @property
    def description(self) -> str:
        if self.shape in (MOONCAKE, MOONCAKE_2ND_HALF):
            return shown(self.path)
        return f"synthetic, seed {self.seed}, scale {self.scale:g}: {shapes.describe(self.shape)}"


@dataclass(frozen=True)
class Requests:
    ids: list[list[int]]
    #: The requests before this index only warm the cache.
    measure_from: int


@functools.lru_cache(maxsize=2)
def load(source: Source) -> Requests:
    """A source's requests, the last two kept: a worker's next job is most often on the same shape."""
    if source.shape not in (MOONCAKE, MOONCAKE_2ND_HALF):
        return Requests([ids for _, ids in shapes.generate(source.shape, source.seed, source.scale)], 0)
    timed = []
    for i, request in enumerate(read_timed_trace(source.path)):
        if source.limit is not None and i >= source.limit:
            break
        timed.append(request)
    measure_from = halfway([t for t, _ in timed]) if source.shape == MOONCAKE_2ND_HALF else 0
    return Requests([ids for _, ids in timed], measure_from)


# -- results ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Line:
    """One series at one capacity: a policy (or Belady) with one tier or host + disk."""

    policy: str  # a name in kvtier.policy.POLICIES, or BELADY
    disk: bool
    admission: str | None
    rate: float
    #: Host+disk replays only: hit rates per tier, pages written to disk, and those
    #: writes per block served from disk (inf: written, never read).
    host_rate: float | None = None
    disk_rate: float | None = None
    disk_writes: int | None = None
    writes_per_hit: float | None = None
    #: Replays only: blocks looked up per second of the policies' own bookkeeping.
    policy_blocks_per_second: float | None = None

    @property
    def name(self) -> str:
        name = f"{self.policy} host+disk" if self.disk else self.policy
        return f"{name} ({self.admission})" if self.admission else name


@dataclass(frozen=True)
class Point:
    """One capacity: every series' line."""

    host_pages: int
    disk_pages: int
    lines: dict[str, Line]  # series name -> line

    @property
    def host_tokens(self) -> int:
        return self.host_pages * TRACE_BLOCK_TOKENS

    @property
    def rates(self) -> dict[str, float]:
        return {name: line.rate for name, line in self.lines.items()}

    @property
    def tier_rates(self) -> dict[str, dict[str, float]]:
        return {n: {"host": x.host_rate, "disk": x.disk_rate} for n, x in self.lines.items() if x.host_rate is not None}

    def ratio_vs_lru(self, name: str) -> float | None:
        """The series' hit rate over lru's with the same tiers, None without an lru line or
        when lru hits nothing. With disk admissions, host+disk series are divided by lru's
        with the first admission given (lines are kept in the order run_shapes asked for
        them): the baseline, so a second admission's gain or loss shows."""
        line = self.lines[name]
        lru = next((x for x in self.lines.values() if x.policy == REFERENCE and x.disk == line.disk), None)
        return line.rate / lru.rate if lru and lru.rate else None


def _finite(x: float | None) -> float | None:
    """JSON has no infinity: None stands for it (writes never read, or no time measured)."""
    return None if x is None or x == INFINITE else x


@dataclass(frozen=True)
class TraceResult:
    """One shape's figures."""

    date: str
    shape: str
    trace: str
    requests: int  # counted (after the warm-up ones)
    warmup_requests: int
    blocks: int  # counted
    infinite: float
    disk_factor: int
    admissions: tuple[str, ...]
    points: tuple[Point, ...]
    seconds: float  # the whole run's, every shape of it

    @property
    def series(self) -> list[str]:
        names: list[str] = []
        for p in self.points:
            names += [n for n in p.lines if n not in names]
        return names

    def lowest_ratio_vs_lru(self) -> dict[str, float]:
        """Each series' lowest `x lru` over the capacities, lru's own left out: "never below
        lru by more than 1%" holds where this is at least 0.99."""
        lowest: dict[str, float] = {}
        for p in self.points:
            for name, line in p.lines.items():
                ratio = p.ratio_vs_lru(name)
                if ratio is not None and line.policy != REFERENCE:
                    lowest[name] = min(ratio, lowest.get(name, ratio))
        return lowest

    def as_dict(self) -> dict:
        def per_series(field: Callable[[Line], float | int | None], p: Point) -> dict:
            return {n: _finite(field(x)) for n, x in p.lines.items() if field(x) is not None}

        return {
            "date": self.date,
            "shape": self.shape,
            "trace": self.trace,
            "requests": self.requests,
            "warmup_requests": self.warmup_requests,
            "blocks": self.blocks,
            "block_tokens": TRACE_BLOCK_TOKENS,
            "infinite": self.infinite,
            "disk_factor": self.disk_factor,
            "admissions": list(self.admissions),
            "seconds": self.seconds,
            "lowest_ratio_vs_lru": self.lowest_ratio_vs_lru(),
            "points": [
                {"host_pages": p.host_pages, "host_tokens": p.host_tokens, "disk_pages": p.disk_pages,
                 "hit_rate": p.rates, "tier_hit_rate": p.tier_rates,
                 "ratio_vs_lru": {n: p.ratio_vs_lru(n) for n in p.lines},
                 "disk_writes": per_series(lambda x: x.disk_writes, p),
                 "disk_writes_per_hit": per_series(lambda x: x.writes_per_hit, p),
                 "policy_blocks_per_second": per_series(lambda x: x.policy_blocks_per_second, p)}
                for p in self.points
            ],
        }


# -- the run ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Job:
    """One replay (or one Belady count) of one shape at one capacity."""

    source: Source
    host_pages: int
    disk_pages: int
    policy: str
    admission: str | None


def _run_job(job: _Job) -> tuple[_Job, Line]:
    requests = load(job.source)
    disk = job.disk_pages > 0
    if job.policy == BELADY:
        hits, blocks = belady_hits(requests.ids, job.host_pages + job.disk_pages, requests.measure_from)
        return job, Line(BELADY, disk, None, hits / blocks if blocks else 0.0)
    if not disk:  # one tier: the policy alone gives the same figures, faster (kvtier.replay.policy)
        r = replay_policy(requests.ids, pages=job.host_pages, policy=job.policy, measure_from=requests.measure_from)
    else:
        admission = {"admission": job.admission} if job.admission else {}
        r = replay(requests.ids, host_pages=job.host_pages, disk_pages=job.disk_pages, policy=job.policy,
                   measure_from=requests.measure_from, **admission)
    tiers = r.as_dict()["tier_hit_rates"]
    return job, Line(job.policy, disk, job.admission, r.block_hit_rate,
                     host_rate=tiers["host"] if disk else None, disk_rate=tiers["disk"] if disk else None,
                     disk_writes=r.disk_writes if disk else None, writes_per_hit=r.disk_writes_per_hit if disk else None,
                     policy_blocks_per_second=r.policy_blocks_per_second)


def _jobs(source: Source, capacities: Sequence[int], policies: Sequence[str], admissions: Sequence[str],
          disk_factor: int) -> list[_Job]:
    """Every line of one shape, in the order the table shows them."""
    jobs = []
    for c in capacities:
        disk = c * disk_factor
        jobs += [_Job(source, c, 0, p, None) for p in policies]
        if disk_factor:
            jobs += [_Job(source, c, disk, p, a) for a in (admissions or (None,)) for p in policies]
        jobs.append(_Job(source, c, 0, BELADY, None))
        if disk_factor:
            jobs.append(_Job(source, c, disk, BELADY, None))
    return jobs


def _sources(shape_names: Sequence[str], trace: str, limit: int | None, seed: int, scale: float) -> list[Source]:
    unknown = [s for s in shape_names if s not in SHAPES]
    if unknown:
        raise ValueError(f"unknown trace shape {unknown[0]!r}; use one of {', '.join(SHAPES)}")
    if {MOONCAKE, MOONCAKE_2ND_HALF} & set(shape_names) and not os.path.exists(trace):
        raise FileNotFoundError(f"{absent(trace)}, or pass --trace")
    return [Source(s, trace, limit, seed, scale) for s in dict.fromkeys(shape_names)]


def run_shapes(
    shape_names: Sequence[str] = (MOONCAKE,),
    *,
    trace: str | os.PathLike = DEFAULT_TRACE,
    capacities: Sequence[int] | None = None,
    quick: bool = False,
    policies: Sequence[str] = POLICIES,
    admissions: Sequence[str] = (),
    disk_factor: int = DISK_FACTOR,
    limit: int | None = None,
    seed: int = 0,
    scale: float = 1.0,
    workers: int | None = None,
    progress: Callable[[str], None] = lambda message: None,
) -> list[TraceResult]:
    """Hit rate against capacity for each shape; every replay of every shape goes through
    one process pool. lru is always replayed (the `x lru` reference); `admissions`, when
    given, are passed to replay() for the host+disk lines; `limit` replays only the
    Mooncake trace's first requests and `scale` sizes the synthetic shapes (tests)."""
    start = time.perf_counter()
    sources = _sources(shape_names, str(trace), limit, seed, scale)
    capacities = tuple(capacities or (QUICK_CAPACITIES if quick else CAPACITIES))
    if any(c <= 0 for c in capacities) or disk_factor < 0:
        raise ValueError("capacities must be positive and disk_factor non-negative")
    policies = tuple(dict.fromkeys([REFERENCE, *(_checked(p) for p in policies)]))
    counted = {source.shape: _Counted.of(load(source)) for source in sources}
    for shape, c in counted.items():
        progress(f"trace {shape}: {c.requests:,} requests counted ({c.warmup_requests:,} more before them only warm "
                 f"the cache), {c.blocks:,} blocks, infinite-cache hit rate {c.infinite:.4f}")
    jobs = [job for source in sources for job in _jobs(source, capacities, policies, admissions, disk_factor)]
    lines: dict[tuple[str, int], dict[str, Line]] = {(s.shape, c): {} for s in sources for c in capacities}
    workers = workers or max(1, min(2, os.cpu_count() or 1))
    with progress_bar(progress, "trace replays", len(jobs)) as advance:
        for done, (job, line) in enumerate(_run_all(jobs, workers), 1):
            lines[job.source.shape, job.host_pages][line.name] = line
            advance()
            progress(f"trace: {done} of {len(jobs)} replays: {job.source.shape}, {line.name}, "
                     f"{job.host_pages:,} host pages: {line.rate:.4f}")
    date, seconds = utc_now(), time.perf_counter() - start
    return [
        TraceResult(date=date, shape=s.shape, trace=s.description, requests=counted[s.shape].requests,
                    warmup_requests=counted[s.shape].warmup_requests, blocks=counted[s.shape].blocks,
                    infinite=counted[s.shape].infinite, disk_factor=disk_factor, admissions=tuple(admissions),
                    points=tuple(Point(c, c * disk_factor, lines[s.shape, c]) for c in capacities), seconds=seconds)
        for s in sources
    ]


@dataclass(frozen=True)
class _Counted:
    """What of a shape's requests is counted, and the infinite cache's hit rate on it."""

    requests: int
    warmup_requests: int
    blocks: int
    infinite: float

    @classmethod
    def of(cls, requests: Requests) -> "_Counted":
        hits, blocks = infinite_hits(requests.ids, requests.measure_from)
        return cls(len(requests.ids) - requests.measure_from, requests.measure_from, blocks, hits / blocks if blocks else 0.0)


def _run_all(jobs: list[_Job], workers: int) -> Iterator[tuple[_Job, Line]]:
    """The jobs' results in order: from a process pool, or here one after another with one worker."""
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            yield from pool.map(_run_job, jobs)
    else:
        yield from map(_run_job, jobs)


def run_trace(trace: str | os.PathLike = DEFAULT_TRACE, *, shape: str = MOONCAKE, **kwargs) -> TraceResult:
    """One shape's figures (`kvtier bench all`'s trace section); see run_shapes."""
    return run_shapes((shape,), trace=trace, **kwargs)[0]



# -- what a disk codec buys ---------------------------------------------------------------
#: The codec table's host tier (3M tokens) and disks, in raw-equivalent tokens: the bytes of
#: that many tokens' raw pages, which hold ratio times as many pages under a codec.
CODEC_HOST_PAGES = 5859
CODEC_DISK_TOKENS = (30_000_000, 10_000_000, 3_000_000)
CODEC_NAMES = tuple(CODECS)
IDENTITY = "identity"


@dataclass(frozen=True)
class CodecLine:
    """One codec on one disk: the replay's line (host + disk through the real BlockStore)."""

    raw_disk_pages: int
    ratio: CodecRatio
    line: Line

    @property
    def disk_pages(self) -> int:
        return self.ratio.pages(self.raw_disk_pages)

    @property
    def reads_per_hit(self) -> float:
        """Pages read from disk per block hit (each disk hit is one page read)."""
        return self.line.disk_rate / self.line.rate if self.line.rate else 0.0


@dataclass(frozen=True)
class CodecResult:
    date: str
    trace: str
    requests: int
    blocks: int
    infinite: float
    host_pages: int
    policy: str
    layout: str
    lines: tuple[CodecLine, ...]
    seconds: float

    def reference(self, line: CodecLine) -> CodecLine | None:
        """identity's line on the same disk."""
        return next((x for x in self.lines if x.ratio.codec == IDENTITY and x.raw_disk_pages == line.raw_disk_pages), None)

    def versus(self, line: CodecLine) -> tuple[float | None, float | None]:
        """(hit rate, disk reads per hit) over identity's on the same disk."""
        ref = self.reference(line)
        if ref is None:
            return None, None
        return (line.line.rate / ref.line.rate if ref.line.rate else None,
                line.reads_per_hit / ref.reads_per_hit if ref.reads_per_hit else None)

    def as_dict(self) -> dict:
        return {"date": self.date, "trace": self.trace, "requests": self.requests, "blocks": self.blocks,
                "block_tokens": TRACE_BLOCK_TOKENS, "infinite": self.infinite, "host_pages": self.host_pages,
                "policy": self.policy, "layout": self.layout, "seconds": self.seconds,
                "lines": [{**x.ratio.as_dict(), "raw_disk_pages": x.raw_disk_pages, "disk_pages": x.disk_pages,
                           "raw_disk_tokens": x.raw_disk_pages * TRACE_BLOCK_TOKENS, "hit_rate": x.line.rate,
                           "host_hit_rate": x.line.host_rate, "disk_hit_rate": x.line.disk_rate,
                           "disk_reads_per_hit": x.reads_per_hit, "hit_rate_x_identity": self.versus(x)[0],
                           "disk_reads_per_hit_x_identity": self.versus(x)[1]} for x in self.lines]}


def run_codecs(trace: str | os.PathLike = DEFAULT_TRACE, *, codecs: Sequence[str] = CODEC_NAMES,
               disk_tokens: Sequence[int] = CODEC_DISK_TOKENS, host_pages: int = CODEC_HOST_PAGES,
               policy: str = REFERENCE, layout=DEFAULT_LAYOUT, limit: int | None = None, workers: int | None = None,
               progress: Callable[[str], None] = lambda message: None) -> CodecResult:
    """The Mooncake trace with host `host_pages` and each disk of `disk_tokens` raw-equivalent
    tokens, once per codec with the disk scaled by the codec's ratio (measured on synthetic
    pages of `layout`, kvtier.replay.codec); identity is always replayed (the reference)."""
    start = time.perf_counter()
    source = _sources((MOONCAKE,), str(trace), limit, 0, 1.0)[0]
    ratios = [measure_ratio(c, layout) for c in dict.fromkeys([IDENTITY, *codecs])]
    for r in ratios:
        progress(f"codec {r.codec}: ratio {r.ratio:.3f} ({r.source})")
    raw = [round(t / TRACE_BLOCK_TOKENS) for t in disk_tokens]
    if host_pages <= 0 or any(d <= 0 for d in raw):
        raise ValueError(f"the host and every disk need at least one {TRACE_BLOCK_TOKENS}-token page")
    wanted = [(d, r) for d in raw for r in ratios]
    jobs = list(dict.fromkeys(_Job(source, host_pages, r.pages(d), _checked(policy), None) for d, r in wanted))
    done: dict[int, Line] = {}
    with progress_bar(progress, "codec replays", len(jobs)) as advance:
        for job, line in _run_all(jobs, workers or max(1, min(2, os.cpu_count() or 1))):
            done[job.disk_pages] = line
            advance()
            progress(f"codecs: disk {job.disk_pages:,} pages: {line.rate:.4f}")
    counted = _Counted.of(load(source))
    return CodecResult(date=utc_now(), trace=source.description, requests=counted.requests, blocks=counted.blocks,
                       infinite=counted.infinite, host_pages=host_pages, policy=policy,
                       layout=describe(layout), lines=tuple(CodecLine(d, r, done[r.pages(d)]) for d, r in wanted),
                       seconds=time.perf_counter() - start)


CODEC_COLUMNS = ("disk, raw-eq. tokens", "codec", "ratio", "disk pages", "hit rate", "x identity", "from disk",
                 "disk reads/hit", "x identity", "disk bytes/hit")


def _codec_rows(result: CodecResult) -> list[list[str]]:
    rows = []
    for x in result.lines:
        rate, reads = result.versus(x)
        rows.append([f"{x.raw_disk_pages:,} ({_tokens(x.raw_disk_pages)})", x.ratio.codec, f"{x.ratio.ratio:.3f}",
                     f"{x.disk_pages:,}", _number(x.line.rate), _number(rate, 3), _number(x.line.disk_rate),
                     _number(x.reads_per_hit, 3), _number(reads, 3), _number(x.reads_per_hit / x.ratio.ratio, 3)])
    return rows


def _codec_about(result: CodecResult) -> list[str]:
    by_source: dict[str, dict[str, float]] = {}
    for x in result.lines:
        if x.ratio.codec != IDENTITY:
            by_source.setdefault(x.ratio.source, {})[x.ratio.codec] = x.ratio.ratio
    sources = "; ".join(", ".join(f"{c} {r:.3f}" for c, r in ratios.items()) + f" ({source})"
                        for source, ratios in by_source.items())
    return [(f"{result.requests:,} requests, {result.blocks:,} blocks of {TRACE_BLOCK_TOKENS} tokens; host "
             f"{result.host_pages:,} pages ({_tokens(result.host_pages)} tokens, never encoded); policy "
             f"{result.policy}; infinite capacity: {result.infinite:.4f}."),
            ("A disk of N raw-equivalent tokens has the bytes of N tokens' raw pages and holds ratio times as many "
             "under a codec. disk reads/hit: pages read from disk per block hit; disk bytes/hit: the bytes those "
             "reads move, in raw pages (reads/hit / ratio); x identity: over identity's on the same disk."),
            f"Ratios: {sources or '-'}."]


def format_codec_table(result: CodecResult) -> str:
    rows = [list(CODEC_COLUMNS), *_codec_rows(result)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(CODEC_COLUMNS))]
    lines = [f"kvtier bench trace --codec, {result.date}: {result.trace}", ""]
    lines += ["  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join([*lines, "", *_codec_about(result)])


def format_codec_markdown(result: CodecResult) -> str:
    lines = ["| " + " | ".join(CODEC_COLUMNS) + " |", "|---|---|" + "---:|" * (len(CODEC_COLUMNS) - 2)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in _codec_rows(result)), "", *_codec_about(result)])

# -- output -------------------------------------------------------------------------------
def _tokens(pages: int) -> str:
    tokens = pages * TRACE_BLOCK_TOKENS
    return f"{tokens / 1e6:.1f}M"


def _number(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "-"
    return "inf" if x == INFINITE else f"{x:.{digits}f}"


def _speed(x: float | None) -> str:
    return "-" if x is None or x == INFINITE else f"{x / 1e6:.2f}M"


COLUMNS = ("host pages (tokens)", "series", "hit rate", "x lru", "host", "disk", "disk writes", "writes/disk hit",
           "policy blocks/s")


def _rows(result: TraceResult) -> list[list[str]]:
    """One row per capacity and series, cells as COLUMNS."""
    rows = []
    for p in result.points:
        for name, x in p.lines.items():
            rows.append([f"{p.host_pages:,} ({_tokens(p.host_pages)})", name, _number(x.rate), _number(p.ratio_vs_lru(name), 3),
                         _number(x.host_rate), _number(x.disk_rate), "-" if x.disk_writes is None else f"{x.disk_writes:,}",
                         _number(x.writes_per_hit, 2), _speed(x.policy_blocks_per_second)])
    return rows


def _about(result: TraceResult) -> list[str]:
    warmup = (f"; the first {result.warmup_requests:,} requests (the first half by time) only warm the cache"
              if result.warmup_requests else "")
    lowest = ", ".join(f"{n} {r:.3f}" for n, r in result.lowest_ratio_vs_lru().items())
    return [
        f"{result.requests:,} requests, {result.blocks:,} blocks of {TRACE_BLOCK_TOKENS} tokens counted{warmup}.",
        f"Infinite capacity: {result.infinite:.4f}. Lowest x lru over the capacities: {lowest or '-'}.",
    ]


def format_table(result: TraceResult) -> str:
    rows = [list(COLUMNS), *_rows(result)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = [
        f"kvtier bench trace, {result.date}: {result.shape}: {result.trace}",
        (f"Block hit rate (leading cached blocks / blocks looked up); host+disk: a disk tier of {result.disk_factor}x "
         "the host pages; x lru: hit rate / lru's, same capacity and tiers; belady: offline farthest-next-use, one "
         "tier (host+disk: of both tiers' pages), not prefix-aware; policy blocks/s: blocks per second of the "
         "policy's own bookkeeping"),
        "",
    ]
    lines += ["  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join([*lines, "", *_about(result)])


def format_markdown(result: TraceResult) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---|---|" + "---:|" * (len(COLUMNS) - 2)]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(result)]
    lines += ["", *_about(result),
              (f"Belady: offline farthest-next-use, one tier, not prefix-aware (host+disk: one tier of both tiers' pages). "
               f"host+disk: a disk tier of {result.disk_factor}x the host pages behind it (write-back). x lru: hit rate "
               "/ lru's, same capacity and tiers.")]
    return "\n".join(lines)


def plot_path(path: str | os.PathLike, shape: str, several: bool) -> Path:
    """Where a shape's plot goes: `path` itself for one shape; trace.png -> trace-zipf.png for several."""
    path = Path(path)
    return path.with_name(f"{path.stem}-{shape}{path.suffix}") if several else path


_COLOURS = {"lru": "tab:blue", "prefix": "tab:orange"}
_MARKERS = ("o", "s", "D", "v", "P", "X", "*", "<", ">", "h")


def plot(result: TraceResult, path: str | os.PathLike) -> None:
    """Hit rate against host capacity (tokens, log scale), one line per series: a colour
    and marker per policy (known ones fixed, others in turn), solid for one tier, dashed
    for host+disk, dash-dot for a second disk admission; the infinite cache dashed grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [p.host_tokens for p in result.points]
    policies = list(dict.fromkeys(line.policy for p in result.points for line in p.lines.values() if line.policy != BELADY))
    disk_styles = dict(zip(result.admissions, ("--", "-.", (0, (3, 1, 1, 1)), (0, (5, 1)))))
    for name in result.series:
        ys = [p.rates.get(name) for p in result.points]
        line = next(p.lines[name] for p in result.points if name in p.lines)
        if line.policy == BELADY:
            ax.plot(xs, ys, linestyle=":", marker="^" if line.disk else "v", color="dimgrey" if line.disk else "black",
                    label=f"Belady (offline, one tier{' of host + disk' if line.disk else ''})")
            continue
        i = policies.index(line.policy)
        ax.plot(xs, ys, color=_COLOURS.get(line.policy, f"C{(i + 2) % 10}"), marker=_MARKERS[i % len(_MARKERS)],
                markersize=4, linestyle=disk_styles.get(line.admission, "--") if line.disk else "-", label=name.replace("host+disk", f"host + {result.disk_factor}x disk"))
    ax.axhline(result.infinite, color="grey", linestyle="--", linewidth=1, label=f"infinite ({result.infinite:.3f})")
    ax.set_xscale("log")
    ax.set_xticks(xs, [_tokens(p.host_pages) for p in result.points])
    ax.minorticks_off()
    ax.set_xlabel("host tier capacity, tokens"
                  + (f" (host+disk: disk = {result.disk_factor}x host)" if result.disk_factor else ", one tier"))
    ax.set_ylabel("block hit rate")
    ax.set_title(f"{result.shape}: hit rate vs capacity")
    ax.set_ylim(0, max(0.05, result.infinite * 1.15))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
