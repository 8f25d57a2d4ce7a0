"""A hypothesis state machine over the load life cycle (kvtier.core.loads) of a real
BlockStore whose page sources hold their loads until the machine lands them.

The store has a host tier, a cluster tier and, in one of the two machines, a disk tier.
Both sources are `HeldSource`s: a load stays queued (as behind a busy reader) until a rule
lands it, ok or failed, or a session end or shutdown withdraws it; back-pressure, boost and
cancel behave as the real readers' (kvtier.mechanism.io). Acquires run on their own
threads, with every wait policy (Wait.NONE = 0, a deadline, Wait.ALL = None), so a rule can
land the loads they wait on, exactly as a prefetch at arrival time followed by the
worker's acquire does in the vLLM connector.

After every step: the store's invariants hold; every job a source was handed (load or
boost) is of that source's tier; the loads in flight are exactly the jobs queued; each
loading host copy is the copy of a queued job and each queued job's copy is loading; and
when nothing is queued any more, every acquire has returned (nothing hangs).
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvtier_client.errors import CapacityError, NotFound, Unavailable
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.core.bookkeeping import BookkeepingDisk, BookkeepingHost
from kvtier.core.invariants import check_invariants
from kvtier.core.ports import LoadJob, LoadKind, Mechanism
from kvtier.core.store import BlockStore

LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=16, block_tokens=4)
NS = "ns"
SESSIONS = ("s1", "s2")
KEYS = [bytes([i]) * 8 for i in range(1, 9)]
#: acquire wait policies: Wait.NONE, a short deadline, Wait.ALL
WAITS = (0.0, 0.02, None)


class HeldSource:
    """A page source of tier `tier` whose loads wait in a queue until `land` (or a cancel).
    `holds` says which keys it can deliver (the cluster: what other nodes wrote)."""

    def __init__(self, tier: Tier, room: int = 3, holds: Callable[[bytes], bool] = lambda key: True) -> None:
        self.tier = tier
        self.room = room
        self.holds = holds
        self.queue: list[LoadJob] = []
        self.misrouted: list[tuple[str, LoadJob]] = []  # (call, job) handed to the wrong source

    def _check(self, call: str, job: LoadJob) -> None:
        if job.source is not self.tier:
            self.misrouted.append((call, job))

    def load(self, job: LoadJob) -> None:
        self._check("load", job)
        self.queue.append(job)

    def prefetch_room(self) -> int:
        return max(0, self.room - sum(job.kind is LoadKind.PREFETCH for job in self.queue))

    def boost(self, job: LoadJob) -> None:
        self._check("boost", job)
        job.kind = LoadKind.ACQUIRE

    def cancel(self, session: str | None, cancellable: Callable[[LoadJob], bool]) -> list[LoadJob]:
        gone = [job for job in self.queue if session in (None, job.session) and cancellable(job)]
        self.queue = [job for job in self.queue if job not in gone]
        return gone

    def land(self, i: int, ok: bool) -> None:
        job = self.queue.pop(i % len(self.queue))
        job.started = True
        job.on_done(job, ok and self.holds(job.record.key))


class HeldDisk(HeldSource, BookkeepingDisk):
    """The disk: writes land at once (books only), loads are held."""

    def __init__(self) -> None:
        HeldSource.__init__(self, Tier.DISK)
        BookkeepingDisk.__init__(self, LAYOUT.page_bytes)


class HeldRemote(HeldSource):
    """The cluster tier: holds `content`'s keys; takes no writes (cluster_write is off)."""

    def __init__(self) -> None:
        self.content: set[bytes] = set()
        super().__init__(Tier.CLUSTER, holds=self.content.__contains__)

    def present(self, namespace: str, keys) -> int:
        return next((i for i, key in enumerate(keys) if key not in self.content), len(keys))

    def write(self, namespace, pages, on_done, *, copy: bool = False) -> bool:
        return False


class LoadMachine(RuleBasedStateMachine):
    with_disk = True

    def __init__(self) -> None:
        super().__init__()
        self.disk = HeldDisk() if self.with_disk else None
        self.remote = HeldRemote()
        ports = Mechanism(BookkeepingHost(), self.disk, self.remote, None)
        self.store = BlockStore(LAYOUT, host_pages=4, disk_pages=6 if self.disk else 0, ports=ports)
        self.sources = [s for s in (self.disk, self.remote) if s is not None]
        self.pending: list[tuple[threading.Thread, list]] = []  # acquires on their threads, and their outcome
        self.leases: list[tuple[str, int]] = []
        self.version = itertools.count()

    def teardown(self) -> None:
        self.store.stop_loads()
        for thread, _ in self.pending:
            thread.join(5)

    # -- requests --------------------------------------------------------------------
    @rule(session=st.sampled_from(SESSIONS), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
    def commit(self, session: str, keys: list[bytes]) -> None:
        try:
            grant = self.store.borrow(session, NS, len(keys))
        except CapacityError:
            return
        self.store.commit(session, grant.lease_id, keys)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def other_node_writes(self, keys: list[bytes]) -> None:
        """Another node wrote these pages to the cluster tier."""
        self.remote.content.update(keys)

    @rule(key=st.sampled_from(KEYS))
    def cluster_evicts(self, key: bytes) -> None:
        self.remote.content.discard(key)

    @rule(session=st.sampled_from(SESSIONS), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
          priority=st.integers(0, 2))
    def prefetch(self, session: str, keys: list[bytes], priority: int) -> None:
        self.store.prefetch(session, NS, keys, Tier.HOST, priority)

    @rule(session=st.sampled_from(SESSIONS), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
          wait=st.sampled_from(WAITS))
    def acquire(self, session: str, keys: list[bytes], wait: float | None) -> None:
        """As an engine does: look up, then acquire the hit prefix on its own thread."""
        hit = self.store.lookup(NS, keys).hit_blocks
        if not hit:
            return
        outcome: list = []

        def run() -> None:
            try:
                outcome.append(self.store.acquire(session, NS, keys[:hit], Tier.HOST, wait))
            except (CapacityError, NotFound, Unavailable) as exc:  # the answers a caller can get
                outcome.append(exc)
            except BaseException as exc:  # noqa: BLE001 - reported by `acquires_end`
                outcome.append(exc)
                raise

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.pending.append((thread, outcome))
        thread.join(0.2)  # most return at once; one waiting on held loads stays pending

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 10))
    def release(self, i: int) -> None:
        session, lease_id = self.leases.pop(i % len(self.leases))
        self.store.release(session, lease_id)

    @rule(session=st.sampled_from(SESSIONS))
    def end_session(self, session: str) -> None:
        self.store.end_session(session)
        self.leases = [(s, lease) for s, lease in self.leases if s != session]

    @rule()
    def shut_down_loads(self) -> None:
        self.store.stop_loads()

    # -- the sources report ------------------------------------------------------------
    @precondition(lambda self: any(s.queue for s in self.sources))
    @rule(which=st.integers(0, 1), i=st.integers(0, 10), ok=st.booleans())
    def land(self, which: int, i: int, ok: bool) -> None:
        sources = [s for s in self.sources if s.queue]
        sources[which % len(sources)].land(i, ok)

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def store_invariants(self) -> None:
        with self.store._lock:  # acquires on their threads may be between two waits
            check_invariants(self.store, None)

    @invariant()
    def every_job_at_its_own_source(self) -> None:
        for source in self.sources:
            assert not source.misrouted, f"{source.tier.label} source was handed another tier's job: {source.misrouted}"

    @invariant()
    def loads_in_flight_are_the_queued_jobs(self) -> None:
        queued = [job for s in self.sources for job in s.queue]
        with self.store._lock:
            assert self.store.stats().loading == len(queued)
            loading = {(ref, id(b.copies[Tier.HOST].job)) for ref, b in self.store.blocks.items()
                       if Tier.HOST in b.copies and b.copies[Tier.HOST].loading}
            assert loading == {((job.record.namespace, job.record.key), id(job)) for job in queued}

    @invariant()
    def acquires_end(self) -> None:
        """Collect the acquires that returned; once nothing is queued, none may still wait."""
        idle = not any(s.queue for s in self.sources)
        still = []
        for thread, outcome in self.pending:
            thread.join(5 if idle else 0)
            if thread.is_alive():
                assert not idle, "an acquire still waits with no load queued anywhere: it hangs"
                still.append((thread, outcome))
                continue
            (result,) = outcome
            if isinstance(result, BaseException) and not isinstance(result, (CapacityError, NotFound, Unavailable)):
                raise AssertionError(f"acquire raised {result!r}") from result
            if not isinstance(result, BaseException):
                self.leases.append((self._session_of(result), result.lease_id))
        self.pending = still

    def _session_of(self, grant) -> str:
        return self.store.leases[grant.lease_id].session


class LoadMachineNoDisk(LoadMachine):
    with_disk = False


_settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestLoads = pytest.mark.timeout(240)(LoadMachine.TestCase)
TestLoads.settings = _settings
TestLoadsNoDisk = pytest.mark.timeout(240)(LoadMachineNoDisk.TestCase)
TestLoadsNoDisk.settings = _settings
