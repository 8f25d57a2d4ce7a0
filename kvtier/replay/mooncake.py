"""Replay a Mooncake-format trace (one JSON object per line with prefix-chained `hash_ids`,
one id per 512-token block) through a real BlockStore whose mover keeps only the books.

Per request, as the trace's README defines block hit rate: look up the ids, count the
cached prefix, then touch or insert every block in request order (acquire+release for a
cached block, which also promotes it from disk; borrow+commit for a new one).

`measure_from` counts only the requests from that index on (the ones before warm the
cache), so a policy tuned on a trace's first half can be reported on its second half.
The policy's own bookkeeping is timed call by call (`policy_seconds`): the policy must
keep up with the daemon, whatever the rest of the store costs.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.core import BlockStore
from kvtier.core.bookkeeping import bookkeeping_ports
from kvtier.policy import POLICIES, AdmissionName, EvictionPolicy, Ref, make_admission
from kvtier.policy.admission import DEFAULT_THRESHOLD

TRACE_BLOCK_TOKENS = 512
_NAMESPACE = "trace"
_SESSION = "replay"
#: The store needs a layout; replay moves no bytes, so any small one will do.
_LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=8, block_tokens=TRACE_BLOCK_TOKENS, dtype="uint8")


@dataclass(frozen=True)
class ReplayResult:
    requests: int
    blocks: int
    hit_blocks: int
    host_hit_blocks: int
    disk_hit_blocks: int
    host_pages: int
    disk_pages: int
    policy: str
    device_pages: int = 0
    device_hit_blocks: int = 0
    #: Pages written to the disk tier (host -> disk demotions).
    disk_writes: int = 0
    #: Host pages the admission policy kept off the disk.
    disk_refused: int = 0
    admission: str = AdmissionName.ALL.value
    #: Seconds spent inside the policies' methods, all tiers together.
    policy_seconds: float = 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def disk_writes_per_hit(self) -> float:
        """Disk writes per block served from disk (inf: writes that were never read)."""
        if not self.disk_writes:
            return 0.0
        return self.disk_writes / self.disk_hit_blocks if self.disk_hit_blocks else float("inf")

    @property
    def policy_blocks_per_second(self) -> float:
        return self.blocks / self.policy_seconds if self.policy_seconds else float("inf")

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "blocks": self.blocks,
            "policy": self.policy,
            "device_pages": self.device_pages,
            "host_pages": self.host_pages,
            "disk_pages": self.disk_pages,
            "block_hit_rate": self.block_hit_rate,
            "tier_hit_rates": {
                **({"device": self.device_hit_blocks / self.blocks if self.blocks else 0.0} if self.device_pages else {}),
                "host": self.host_hit_blocks / self.blocks if self.blocks else 0.0,
                "disk": self.disk_hit_blocks / self.blocks if self.blocks else 0.0,
            },
            "admission": self.admission,
            "disk_writes": self.disk_writes,
            "disk_refused": self.disk_refused,
            "disk_writes_per_hit": self.disk_writes_per_hit,
            "policy_seconds": self.policy_seconds,
            "policy_blocks_per_second": self.policy_blocks_per_second,
        }


def read_trace(path: str) -> Iterator[list[int]]:
    """The `hash_ids` of each request, in order (see `read_timed_trace`)."""
    for _, ids in read_timed_trace(path):
        yield ids


def read_timed_trace(path: str) -> Iterator[tuple[int, list[int]]]:
    """(timestamp in ms, `hash_ids`) of each request, in order; a line without a
    timestamp takes its predecessor's.

    Every id is checked here, so a bad line is reported with its line number as a
    ValueError (one line from the CLI) instead of failing later inside the store.
    """
    timestamp = 0
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                request = json.loads(line)
                if not isinstance(request, dict) or "hash_ids" not in request:
                    raise ValueError('no "hash_ids" field')
                ids = request["hash_ids"]
                if not isinstance(ids, list):
                    raise TypeError(f"hash_ids must be a list, got {type(ids).__name__}")
                bad = [i for i in ids if type(i) is not int or not 0 <= i < 2**64]
                if bad:
                    raise ValueError(f"hash id {bad[0]!r} is not an integer in [0, 2**64)")
                timestamp = request.get("timestamp", timestamp)
                if type(timestamp) is not int:
                    raise TypeError(f"timestamp must be an integer, got {timestamp!r}")
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace line ({exc})") from None
            yield timestamp, ids


def halfway(timestamps: list[int]) -> int:
    """The index of the first request of the trace's second half by time (the first at or
    after the midpoint of its time span)."""
    if not timestamps:
        return 0
    middle = (timestamps[0] + timestamps[-1]) / 2
    return next(i for i, t in enumerate(timestamps) if t >= middle)


def _key(hash_id: int) -> bytes:
    return hash_id.to_bytes(8, "little")


class TimedPolicy:
    """A policy whose every call adds its duration to a shared clock (a one-item list).
    (Written out per method: a shared wrapper would time its own call too.)"""

    def __init__(self, policy: EvictionPolicy, spent: list[float]) -> None:
        self._policy = policy
        self._spent = spent
        self.name = policy.name

    def add(self, ref: Ref, parent: Ref | None) -> None:
        start = time.perf_counter()
        self._policy.add(ref, parent)
        self._spent[0] += time.perf_counter() - start

    def touch(self, ref: Ref) -> None:
        start = time.perf_counter()
        self._policy.touch(ref)
        self._spent[0] += time.perf_counter() - start

    def remove(self, ref: Ref) -> None:
        start = time.perf_counter()
        self._policy.remove(ref)
        self._spent[0] += time.perf_counter() - start

    def victims(self, n: int, protected: Callable[[Ref], bool]) -> list[Ref]:
        start = time.perf_counter()
        chosen = self._policy.victims(n, protected)
        self._spent[0] += time.perf_counter() - start
        return chosen

    def __len__(self) -> int:
        return len(self._policy)


def replay(requests: Iterable[list[int]], *, host_pages: int, disk_pages: int = 0, policy: str = "lru",
           device_pages: int = 0, measure_from: int = 0, admission: AdmissionName | str = AdmissionName.ALL,
           admission_threshold: float = DEFAULT_THRESHOLD,
           after_request: Callable[[int, list[bytes], BlockStore], None] | None = None) -> ReplayResult:
    """With `device_pages`, cached blocks are acquired into the device tier (as a GPU
    engine would), so they climb disk -> host -> device and fall back the same way.
    Requests before `measure_from` only warm the cache: they are not counted. `admission`
    decides which host pages are written to disk as they leave host. `after_request(index,
    keys, store)` runs after each request is served (a client's hints: kvtier.replay.hints)."""
    spent = [0.0]
    make = POLICIES[policy]
    store = BlockStore(_LAYOUT, host_pages=host_pages, disk_pages=disk_pages, device_pages=device_pages,
                       ports=bookkeeping_ports(_LAYOUT.page_bytes), policy=lambda pages: TimedPolicy(make(pages), spent),
                       admission=make_admission(admission, host_pages, disk_pages, admission_threshold), prefetch_hold=0.0)
    read_into = Tier.DEVICE if device_pages else Tier.HOST
    n_requests = 0
    before = _Counts.of(store)
    for ids in requests:
        if n_requests == measure_from:
            before, spent[0] = _Counts.of(store), 0.0
        n_requests += 1
        keys = [_key(i) for i in ids]
        store.lookup(_NAMESPACE, keys)
        parent: bytes | None = None
        for key in keys:
            if (_NAMESPACE, key) in store.blocks:
                lease = store.acquire(_SESSION, _NAMESPACE, [key], read_into)
                store.release(_SESSION, lease.lease_id)
            else:
                lease = store.borrow(_SESSION, _NAMESPACE, 1)
                store.commit(_SESSION, lease.lease_id, [key], parent=parent)
            parent = key
        if after_request is not None:
            after_request(n_requests - 1, keys, store)
    if n_requests <= measure_from:
        raise ValueError(f"the trace has {n_requests} requests: none from request {measure_from} on to measure")
    counts = _Counts.of(store).minus(before)
    return ReplayResult(
        requests=n_requests - measure_from,
        blocks=counts.blocks,
        hit_blocks=counts.blocks - counts.misses,
        host_hit_blocks=counts.hits[Tier.HOST],
        disk_hit_blocks=counts.hits[Tier.DISK],
        host_pages=host_pages,
        disk_pages=disk_pages,
        policy=policy,
        device_pages=device_pages,
        device_hit_blocks=counts.hits[Tier.DEVICE],
        disk_writes=counts.disk_writes,
        disk_refused=counts.disk_refused,
        admission=AdmissionName(admission).value,
        policy_seconds=spent[0],
    )


@dataclass(frozen=True)
class _Counts:
    """The store's running totals at one moment of a replay."""

    blocks: int
    misses: int
    hits: dict[Tier, int]
    disk_writes: int
    disk_refused: int

    @classmethod
    def of(cls, store: BlockStore) -> "_Counts":
        stats = store.stats()
        tiers = {t: stats.tier(t) for t in (Tier.DEVICE, Tier.HOST, Tier.DISK)}
        disk = tiers[Tier.DISK]
        return cls(stats.lookup_blocks, stats.miss_blocks, {t: s.counters.hits if s else 0 for t, s in tiers.items()},
                   disk.counters.demotions if disk else 0, disk.counters.refused if disk else 0)

    def minus(self, earlier: "_Counts") -> "_Counts":
        return _Counts(self.blocks - earlier.blocks, self.misses - earlier.misses,
                       {t: n - earlier.hits[t] for t, n in self.hits.items()}, self.disk_writes - earlier.disk_writes,
                       self.disk_refused - earlier.disk_refused)
