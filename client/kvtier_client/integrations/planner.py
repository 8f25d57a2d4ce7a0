"""Never slower than recompute: how many cached prefix blocks an engine should load.

Loading a cached block costs bytes / bandwidth for every tier the page climbs through;
recomputing it costs its tokens / the engine's prefill rate. Because a KV prefix is only
usable from the start, the choice is a prefix length n (0 <= n <= cached blocks): load
blocks [0, n), recompute the rest. `plan_load` picks the n with the smallest estimated
time, so a prefix whose tail sits on a slow disk is cut where loading stops paying, and a
machine whose disk is slower than its prefill never loads from disk at all.

The figures are measured, never configured: tier bandwidths come from the daemon
(`Stats`, a probe at pool creation refined by real reads), the prefill rate from the
engine (`Planner.observe_prefill` after each prefill), the rate at which the engine copies
loaded pages into its own KV from the engine too (`Planner.observe_copy`), the fixed cost
of a load from the round trip of the Stats call itself. Until the engine has measured a
prefill the planner loads every cached block (the daemon's figures alone cannot say
recompute is faster).

The daemon's host figure is a memcpy out of the arena: its estimate of the step the engine
really does, copying a page out of host memory into its KV blocks. That copy is often slower
(strided into the engine's layout, scattered over its blocks). Once the engine has measured
it, the step costs the slower of the two rates: both describe the same bytes moving once, so
they are not added (that would count the copy twice), and the slower errs towards
recomputing, as the rest of the planner does.

Prefill cost per token grows with context (attention), so a linear rate slightly
under-prices recomputing late blocks: the planner errs towards recomputing, never
towards a load slower than the recompute it replaces.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier_client.results import LookupResult
from kvtier_client.tiers import Tier

if TYPE_CHECKING:
    from kvtier_client.client import KVTierClient

#: Weight of a new prefill measurement in the moving average.
PREFILL_ALPHA = 0.3
#: Weight of a new engine-side copy measurement in its moving average.
COPY_ALPHA = 0.3


@dataclass(frozen=True)
class LoadPlan:
    """Load the first `load_blocks` of `cached_blocks`; recompute everything after them."""

    load_blocks: int
    cached_blocks: int
    load_seconds: float  # estimated: fixed cost + bytes through each tier's bandwidth
    recompute_seconds: float  # estimated: the cached blocks not loaded, at the prefill rate
    reason: str

    @property
    def declined_blocks(self) -> int:
        """Cached blocks recomputed because loading them would be slower."""
        return self.cached_blocks - self.load_blocks


def _climb(tier: Tier, into: Tier) -> list[Tier]:
    """The tiers a page leaves on its way from `tier` to the engine, which reads from `into`:
    its own and every faster one down to `into`. A cluster page is fetched into host memory
    directly, so it never passes through disk."""
    steps = [Tier(step) for step in range(into, tier + 1)]
    if tier == Tier.CLUSTER and Tier.DISK in steps:
        steps.remove(Tier.DISK)
    return steps


def load_seconds_per_block(tier: Tier, *, page_bytes: int, bandwidth: Mapping[Tier, float], into: Tier) -> float:
    """Seconds to bring one page from `tier` into the engine through tier `into`.

    `bandwidth[t]` is the rate at which pages leave tier t towards the engine (disk: into
    host memory; host: copied out of the shared arena; cluster: fetched into host memory).
    A page climbs every tier from its own up to `into` (a cluster page skips disk). An
    unmeasured (0) tier counts as free: the planner then cannot tell and loads.
    """
    seconds = 0.0
    for step in _climb(tier, into):
        rate = bandwidth.get(step, 0.0)
        if rate > 0:
            seconds += page_bytes / rate
    return seconds


def effective_bandwidth(bandwidth: Mapping[Tier, float], *, into: Tier,
                        copy_bytes_per_second: float | None) -> dict[Tier, float]:
    """The daemon's tier bandwidths with the engine's measured copy rate folded into the
    `into` step: the slower of the two (see the module docstring), the engine's alone when
    the daemon has no figure for that tier."""
    rates = dict(bandwidth)
    if copy_bytes_per_second:
        daemon = rates.get(into, 0.0)
        rates[into] = min(daemon, copy_bytes_per_second) if daemon > 0 else copy_bytes_per_second
    return rates


def plan_load(
    tiers: Sequence[Tier],
    *,
    page_bytes: int,
    block_tokens: int,
    bandwidth: Mapping[Tier, float],
    prefill_tokens_per_second: float | None,
    fixed_seconds: float = 0.0,
    into: Tier = Tier.HOST,
    copy_bytes_per_second: float | None = None,
) -> LoadPlan:
    """The prefix length to load, given the tier of each cached block (`LookupResult.tiers`).
    `copy_bytes_per_second` is the engine's measured rate of copying loaded pages into its own
    KV (None: not measured; the daemon's figure for `into` stands alone)."""
    cached = len(tiers)
    rates = effective_bandwidth(bandwidth, into=into, copy_bytes_per_second=copy_bytes_per_second)
    per_block = [load_seconds_per_block(t, page_bytes=page_bytes, bandwidth=rates, into=into) for t in tiers]
    if cached == 0:
        return LoadPlan(0, 0, 0.0, 0.0, "nothing cached")
    if not prefill_tokens_per_second:
        return LoadPlan(cached, cached, fixed_seconds + sum(per_block), 0.0,
                        "prefill rate not measured yet: loading every cached block")
    recompute_block = block_tokens / prefill_tokens_per_second
    best_n, best_cost = 0, cached * recompute_block
    loaded = fixed_seconds
    for n in range(1, cached + 1):
        loaded += per_block[n - 1]
        cost = loaded + (cached - n) * recompute_block
        if cost < best_cost:
            best_n, best_cost = n, cost
    load = fixed_seconds + sum(per_block[:best_n]) if best_n else 0.0
    recompute = (cached - best_n) * recompute_block
    if best_n == cached:
        reason = "loading every cached block is faster than recomputing"
    elif best_n == 0:
        reason = (f"recomputing is faster: a block prefills in {recompute_block * 1e3:.3f} ms, "
                  f"loading the cached prefix would take {(fixed_seconds + sum(per_block)) * 1e3:.3f} ms")
    else:
        slow = sorted({tiers[i].label for i in range(best_n, cached)})
        reason = f"loading {best_n} blocks; the rest (in {', '.join(slow)}) recompute faster than they load"
    return LoadPlan(best_n, cached, load, recompute, reason)


class Planner:
    """Plans loads for one registered client from the daemon's measured tier bandwidths and
    the engine's measured prefill and copy rates. Thread-safe; bandwidths refresh every
    `refresh_seconds` (one Stats call)."""

    def __init__(self, client: "KVTierClient", *, into: Tier = Tier.HOST, refresh_seconds: float = 5.0) -> None:
        self._client = client
        self._into = into
        self._refresh_seconds = refresh_seconds
        self._lock = threading.Lock()
        self._bandwidth: dict[Tier, float] = {}
        self._fixed_seconds = 0.0
        self._fetched_at = float("-inf")
        self._prefill_rate: float | None = None
        self._copy_rate: float | None = None

    @property
    def prefill_tokens_per_second(self) -> float | None:
        with self._lock:
            return self._prefill_rate

    @property
    def copy_bytes_per_second(self) -> float | None:
        """The engine's measured rate of copying loaded pages into its KV (moving average)."""
        with self._lock:
            return self._copy_rate

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Report a prefill the engine just ran (tokens computed, wall seconds)."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        with self._lock:
            old = self._prefill_rate
            self._prefill_rate = rate if old is None else (1 - PREFILL_ALPHA) * old + PREFILL_ALPHA * rate

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        """Report the engine copying `nbytes` of loaded pages into its own KV in `seconds`
        (the copy alone: not the acquire, not waiting for disk, which the daemon's figures cover)."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            old = self._copy_rate
            self._copy_rate = rate if old is None else (1 - COPY_ALPHA) * old + COPY_ALPHA * rate

    def bandwidth(self) -> dict[Tier, float]:
        """Read bytes per second of each tier of this client's pool, as the daemon measured them."""
        with self._lock:
            stale = time.monotonic() - self._fetched_at > self._refresh_seconds
        if stale:
            # The first Stats of a pool may run the daemon's bandwidth probes: time a second one.
            calls = 2 if self._fetched_at == float("-inf") else 1
            for _ in range(calls):
                start = time.perf_counter()
                stats = self._client.stats()
                round_trip = time.perf_counter() - start
            pool = stats.pool(self._client.pool.pool_id)
            figures = {t.tier: t.read_bytes_per_second for t in pool.tiers} if pool else {}
            with self._lock:
                self._bandwidth, self._fixed_seconds, self._fetched_at = figures, round_trip, time.monotonic()
        with self._lock:
            return dict(self._bandwidth)

    def plan(self, lookup: LookupResult) -> LoadPlan:
        bandwidth = self.bandwidth()
        with self._lock:
            rate, fixed, copy_rate = self._prefill_rate, self._fixed_seconds, self._copy_rate
        pool = self._client.pool
        return plan_load(
            lookup.tiers[: lookup.hit_blocks],
            page_bytes=pool.page_bytes,
            block_tokens=pool.layout.block_tokens,
            bandwidth=bandwidth,
            prefill_tokens_per_second=rate,
            fixed_seconds=fixed,
            into=self._into,
            copy_bytes_per_second=copy_rate,
        )
