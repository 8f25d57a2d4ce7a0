"""The block store: the one owner of residency state for one page layout, behind one lock.

Every slot of every tier is exactly one of

    free     in the tier's SlotAllocator
    writing  held by a write lease (borrowed, not yet committed)
    cached   holding a copy of a block; may be pinned by read leases, or still loading

and the three counts add up to the tier's capacity (kvtier.core.invariants checks it).

This module is the façade: it validates a request, and hands it to the room that does it:

    writes.py    borrow, commit, and `run`: the loop every request runs in, writing pages
                 to disk outside the lock when they must reach it before leaving host
    rounds.py    a request's turn under the lock, and the one hand-over after it
    disk_writes.py  every disk write (prepare, store, file), the write-out before host
                 pages leave host, write-back, the stop copy
    reads.py     lookup, explain, acquire (the ready prefix, lent), acquire-prefix, prefetch; a
                 group lookup's reads and counts (groups.py decides over several stores)
    cluster.py   the cluster tier: what it holds, loads from it, copies to it
    loads.py     the load life cycle for every source (disk, cluster), host -> device
                 promotions, waiting for them
    control.py   clients' hints: pin, retain, demote, drop (`store.control`); hints.py their
                 table, pin_loads.py hard-pinned blocks brought into host
    capacity.py  make room: the policy proposes victims, evictions demote or drop
    index.py     blocks, copies, tier states and counters (BlockIndex)
    leases.py    leases and the sessions holding them (LeaseTable)
    quotas.py    per-namespace quotas (QuotaBook), and the victim picker that keeps their guarantees
    history.py   blocks that left the index, so a miss can say why
    results.py   what the calls return (PrefixMatch, WriteGrant, ReadGrant, ...)
    ports.py     what the core needs from mechanism: one narrow port per tier (Mechanism)
    slots.py     a tier's free slots (SlotAllocator)
    bookkeeping.py  ports with no bytes, for replay and tests

The engine's path to a page, hop by hop and what runs under the lock: docs/architecture.md,
"The path of a page". On a GPU daemon `acquire(keys, DEVICE)` first brings every page into
host that way, then promotes the ready prefix host -> device in one copy-engine submission
whose interprocess CUDA event the lease carries; an evicted device page is demoted to host
when host has no copy. With a cluster tier (shared by nodes, below disk) a lookup asks the
cluster for the rest of its prefix outside the lock; `acquire` and `prefetch` load such
keys through the same load life cycle (`Loads.start_new`), and committed pages go to the
cluster writer at commit or as they are demoted (`cluster_write`).

Capacity failures are decided before anything changes: `victims` only proposes, so a
request that cannot be met raises CapacityError with every structure untouched.

No disk I/O, hashing or populating runs under the lock on the request path: a request
that must evict dirty host pages is run again after they are written outside it
(kvtier.core.writes, kvtier.core.disk_writes), a commit's pages are hashed for the slot
table after it, and a borrow's fresh slots are populated after it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import wraps

from kvtier_client.errors import FailedPrecondition
from kvtier_client.ids import LeaseId, SessionId, Slot
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.core.chunks import ChunkAllocator, DiskSpace
from kvtier.core.capacity import Capacity
from kvtier.core.cluster import ClusterCopies, ClusterWrite
from kvtier.core.control import CacheControl
from kvtier.core.disk_writes import WRITE_BACK_BATCH, DiskWrites
from kvtier.core.held import HeldCopy, held_copies
from kvtier.core.hints import TierRanks
from kvtier.core.history import DEFAULT_HISTORY_SIZE
from kvtier.core.index import (
    Block, BlockIndex, NamespaceCounters, TierCounters, TierState,
)
from kvtier.core.leases import LeaseKind, LeaseRecord, LeaseTable
from kvtier.core.loads import Loads
from kvtier.core.ports import BlockEvents, Mechanism, PageRecord
from kvtier.core.quotas import Quota, check_quotas
from kvtier.core.reads import Reads
from kvtier.core.results import (
    CommitOutcome, Explanation, GroupPages, NamespaceTierUsage, NamespaceUsage, PrefixMatch, ReadGrant,
    StoreUsage, TierUsage, WriteGrant,
)
from kvtier.core.slots import SlotAllocator
from kvtier.core.rounds import Rounds
from kvtier.core.writes import Writes
from kvtier.policy import Admission, EvictionPolicy, LRUPolicy, Ref, Watched
from kvtier.policy.classes import Ranked


def _locked(method):
    @wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class BlockStore:
    """Index, leases and sessions for one layout's host tier and optional device and disk tiers.

    `policy` makes one eviction policy object per tier from its page count (a policy class will do).
    `admission` decides which host pages leaving host are written to disk (default: all;
    pages committed write-through and the stop-time copy are always written).
    `recovered` is the disk tier's persisted index, filed as cached disk pages (in the
    chunks of its port's `space`, kvtier.core.chunks);
    `recovered_host` the host pages adopted from a crashed daemon's arena (`host_reused`:
    that arena's other slots may hold anyone's bytes). `history_size`: blocks that left
    the index remembered (all namespaces together), to explain misses. `ports` reach the tiers'
    bytes; with a remote port the store has a cluster tier (`cluster_write`: when pages are
    copied to it).
    """

    def __init__(
        self,
        layout: PageLayout,
        *,
        host_pages: int,
        ports: Mechanism,
        disk_pages: int = 0,
        device_pages: int = 0,
        policy: Callable[[int], EvictionPolicy] = LRUPolicy,
        admission: Admission | None = None,
        write_through: bool = False,
        prefetch_hold: float = 10.0,
        recovered: Iterable[PageRecord] = (),
        recovered_host: Iterable[PageRecord] = (),
        host_reused: bool = False,
        history_size: int = DEFAULT_HISTORY_SIZE,
        cluster_write: ClusterWrite = ClusterWrite.OFF,
    ) -> None:
        if host_pages <= 0:
            raise ValueError("the host tier needs at least one page: it is where engines read and write pages")
        self.layout = layout
        self.write_through = write_through
        #: A cluster tier below the others: lookups, acquires and prefetches go on to it
        #: for keys this node does not hold, and pages are copied to it per `cluster_write`.
        self.cluster = ports.remote is not None
        self.cluster_write = cluster_write if self.cluster else ClusterWrite.OFF
        if self.cluster_write is ClusterWrite.DEMOTE and disk_pages <= 0:
            raise ValueError("cluster_write = demote copies pages as they are demoted to disk: it needs a disk tier")
        adopted = list(recovered_host)
        host_policy = policy(host_pages)
        if admission is not None and admission.listens and disk_pages > 0:
            host_policy = Watched(host_policy, admission)  # it learns from the host tier's events
        tiers = [TierState(Tier.HOST, SlotAllocator(host_pages, used=[r.slot for r in adopted]), host_policy)]
        if device_pages > 0:
            tiers.append(TierState(Tier.DEVICE, SlotAllocator(device_pages), policy(device_pages)))
        records = list(recovered) if disk_pages > 0 else []
        if disk_pages > 0:
            space = ports.disk.space or DiskSpace(disk_pages, layout.slot_bytes, 1)  # a chunk a page
            tiers.append(TierState(Tier.DISK, SlotAllocator(disk_pages, used=[r.slot for r in records]), policy(disk_pages),
                                   chunks=ChunkAllocator(space.chunks, [r.extent for r in records]), space=space))
        self._lock = threading.RLock()
        self._index = BlockIndex(tiers, host_reused=host_reused, history_size=history_size)
        if disk_pages > 0:
            self._index.recover_disk(records)
        self._index.recover_host(adopted)
        self._leases = LeaseTable()
        self._rounds = Rounds(self._lock, ports)
        self._capacity = Capacity(self._index, ports, self._rounds, layout, admission)
        self._loads = Loads(self._index, self._capacity, self._rounds, ports, layout, self._lock, prefetch_hold)
        remote = ClusterCopies(self._index, self._loads, ports.remote, self._lock) if self.cluster else None
        self._disk_writes = DiskWrites(self._index, self._capacity, self._rounds, ports, self._lock, layout.page_bytes,
                                       remote, self.cluster_write)
        self._capacity.write_out = self._disk_writes.write_out_first
        self._writes = Writes(self._index, self._leases, self._capacity, self._rounds, self._disk_writes, ports,
                              layout, write_through=write_through, cluster=remote)
        self._reads = Reads(self._index, self._leases, self._loads, ports, self._lock, self._writes.run, remote)
        self._ports = ports
        for state in self._index.tiers.values():  # clients' hints rank victims in every tier
            state.policy = Ranked(state.policy, TierRanks(self._index.hints, state.tier))
        #: Clients' pins, retains, demotes and drops (kvtier.core.control).
        self.control = CacheControl(self._index, self._capacity, self._disk_writes, self._lock, self._writes.run,
                                    lambda session, namespace, keys: self.prefetch(session, namespace, keys))

    # -- read-only views, for invariants and tests ----------------------------
    @property
    def blocks(self) -> dict[Ref, Block]:
        return self._index.blocks

    @property
    def tiers(self) -> dict[Tier, TierState]:
        return self._index.tiers

    @property
    def leases(self) -> dict[LeaseId, LeaseRecord]:
        return self._leases.leases

    @property
    def sessions(self) -> dict[SessionId, set[LeaseId]]:
        return self._leases.sessions

    def held(self, namespace: str | None = None) -> list[HeldCopy]:
        """Every copy in place now (of one namespace, or all), parents first, read a chunk
        at a time under the lock (kvtier.core.held): KV events re-announce them."""
        return held_copies(self._index, self._lock, namespace)

    @property
    def events(self) -> BlockEvents | None:
        """Told of every copy that arrives in or leaves a tier (KV events); None by default."""
        return self._index.events

    @events.setter
    def events(self, sink: BlockEvents | None) -> None:
        """Set the sink. Copies already in place (recovered from disk, adopted from a crashed
        daemon) are not told as arrivals: they are state, which the publisher reads with
        `held` and tells as such (kvtier.events.publisher)."""
        with self._lock:
            self._index.events = sink

    @property
    def forgetting(self) -> set[PageRecord]:
        """Disk pages dropped from the index whose entries in the disk tier's own index are
        being deleted, outside the lock (a worker that just dropped a corrupt page)."""
        return self._rounds.forgetting

    @property
    def saving(self) -> dict[Ref, PageRecord]:
        """Disk writes in flight: each saved block and the record it will be filed with."""
        return self._disk_writes.saving

    # -- queries --------------------------------------------------------------
    def lookup(self, namespace: str, keys: list[bytes], known: int = 0) -> PrefixMatch:
        """The longest cached prefix of `keys` and the fastest tier of each of its blocks;
        why each key after it missed is counted for the namespace. With a cluster tier, the
        keys after this node's prefix are asked of the cluster in one batch, outside the
        lock: its leading hits extend the prefix as CLUSTER. The first `known` keys the
        engine holds already: the same answer, but they count as engine blocks, not as
        hits or misses (0 <= known <= len(keys): kvtier_client.protocol.check_known)."""
        return self._reads.lookup(namespace, keys, known)

    def holdings(self, namespace: str, keys: list[bytes]) -> tuple[Tier | None, ...]:
        """The fastest tier of each key's block (None: not cached), prefix or not; counts
        nothing: a group lookup (kvtier.core.groups) counts once it knows the answer."""
        return self._reads.holdings(namespace, keys)

    def count_group(self, namespace: str, keys: list[bytes], pages: GroupPages, hit_blocks: int, known: int = 0) -> None:
        """Count one group of a group lookup: `pages` (the tiers of the pages it needs) and
        its keys after `hit_blocks` as misses, the first `known` blocks as the engine's
        (kvtier.core.groups says why these)."""
        self._reads.count_group(namespace, keys, pages, hit_blocks, known)

    @_locked
    def explain(self, namespace: str, keys: list[bytes]) -> Explanation:
        """What a lookup of `keys` would find, key by key, and for a key not found whether
        it is cached beyond the prefix, left the index (when, why, chosen by which policy)
        or was never stored. Changes no counter and no recency."""
        return self._reads.explain(namespace, keys, self.control.describe)

    @_locked
    def stats(self) -> StoreUsage:
        now = time.monotonic()
        tiers = [
            TierUsage(state.tier, state.slots.capacity, state.slots.free_count, len(state.writing), state.cached,
                      *state.breakdown(self._index.blocks, now), TierCounters(**vars(state.counters)), *state.byte_usage())
            for state in self._index.tiers.values()
        ]
        r = self._index.requests
        namespaces = self._index.namespaces
        by_namespace = tuple(self._namespace_usage(ns, namespaces[ns]) for ns in sorted(namespaces))
        return StoreUsage(
            tuple(tiers), r.lookup_blocks, r.miss_blocks, len(self._leases.leases), len(self._leases.sessions),
            r.acquired_pages, r.ready_on_arrival, r.loads_in_flight, by_namespace,
            len(self._index.history), self._index.history.size, self._index.history.estimated_bytes,
            r.engine_blocks, {t: n for t, n in r.served.items() if n},
        )

    def _namespace_usage(self, namespace: str, counters: NamespaceCounters) -> NamespaceUsage:
        quota = self._capacity.quotas.of(namespace)
        tiers = tuple(
            NamespaceTierUsage(tier, counters.pages[tier], quota.max_pages(tier), quota.guaranteed_pages(tier),
                               counters.hits[tier], counters.evictions[tier])
            for tier in self._index.tiers
        )
        misses = {reason.value: n for reason, n in counters.misses.items()}
        return NamespaceUsage(namespace, tiers, counters.lookup_blocks, counters.miss_blocks, misses,
                              counters.engine_blocks, {t: n for t, n in counters.served.items() if n})

    @_locked
    def set_quotas(self, quotas: Mapping[str, Quota]) -> None:
        """Replace every namespace's quota (a namespace not in `quotas` has none). Raises
        ValueError, keeping the old quotas, if they cannot all be kept in this store's
        tiers. Evicts nothing now: they apply from each namespace's next allocation."""
        check_quotas(quotas, {tier: state.slots.capacity for tier, state in self._index.tiers.items()})
        self._capacity.quotas.set(quotas)
        self.control.fit_quotas()

    @_locked
    def session_leases(self, session: SessionId) -> int:
        """How many leases a session holds in this store (Heartbeat reports it)."""
        return len(self._leases.sessions.get(session, ()))

    # -- write path -----------------------------------------------------------
    def borrow(self, session: SessionId, namespace: str, n: int) -> WriteGrant:
        """A write lease on n free host pages, evicting or demoting cached pages if needed.
        Slots that change holder are populated after the lock is released."""
        grant, given = self._writes.run(lambda: self._writes.borrow(session, namespace, n))
        if given:
            self._ports.host.populate(given, namespace)
        return grant

    def commit(self, session: SessionId, lease_id: LeaseId, keys: list[bytes], parent: bytes | None = None,
               tokens: list[tuple[int, ...]] | None = None, checksums: list[int] | None = None) -> CommitOutcome:
        """Publish a write lease's pages: page i becomes the cached copy of keys[i].

        `parent` is the key of the block before keys[0] in its prefix, if there is one. Pages
        beyond len(keys) are freed. The lease ends. With write-through, the new pages are
        written to disk in one batch after the lock is released, before this returns: they
        are hits (and protected) meanwhile, and on disk when the engine hears back.
        `tokens`, when given, are each key's block of token ids (`block_tokens` each): kvtier
        never reads them, it only carries them in its KV events for routers that hash tokens.
        `checksums`, when given, are each page's xxh3-64 as the client wrote it: entered in
        the slot table as they are (a wrong one loses that page at the next check of its
        bytes: adoption, a disk or cluster read); without them the pages are hashed here,
        after the lock is released.
        """
        return self._writes.commit(session, lease_id, keys, parent, tokens, checksums)

    # -- read path ------------------------------------------------------------
    def acquire(
        self, session: SessionId, namespace: str, keys: list[bytes], tier: Tier = Tier.HOST,
        timeout: float | None = None,
    ) -> ReadGrant:
        """A read lease pinning the ready prefix of `keys` in `tier`, loading disk-only pages.

        `timeout` is the wait policy: None waits for every page (and raises NotFound if a
        page fails its checksum: it is dropped, nothing is held); 0 returns what is ready
        now; t > 0 waits up to t seconds. Pages still loading when the call returns keep
        loading and are held for `prefetch_hold` seconds, like a prefetch. Every key must
        be cached (look up first and acquire the hit prefix). Into DEVICE, the wait covers
        the disk -> host part; the host -> device copy is the lease's `transfer`.
        """
        return self._writes.run(lambda: self._reads.acquire(session, namespace, keys, tier, timeout))

    def acquire_prefix(
        self, session: SessionId, namespace: str, keys: list[bytes], tier: Tier = Tier.HOST,
        timeout: float | None = None,
    ) -> tuple[PrefixMatch, ReadGrant | None]:
        """Lookup and acquire in one call: the longest cached prefix of `keys` (at most the
        tier's capacity), acquired as `acquire` would with `timeout`. Under one lock, so no
        eviction falls between the two; the grant is None when nothing is cached. (When the
        acquire must first write pages to disk, it runs again on what is still cached then,
        the lookup counted once. With a cluster tier the lookup asks it outside the lock.)"""
        return self._reads.acquire_prefix(session, namespace, keys, tier, timeout)

    def prefetch(
        self, session: SessionId, namespace: str, keys: list[bytes], tier: Tier = Tier.HOST, priority: int = 0,
        hold: float = 0.0,
    ) -> int:
        """Start loading the disk-only pages of `keys` into `tier` (and, with a cluster tier,
        the pages after this node's prefix that the cluster holds); returns at once.

        A hint, best effort: it stops at the first key that is not cached, when the
        prefetch queue is full (back-pressure) or when no room can be made. A loaded page is
        held for `hold` seconds (the client's deadline; 0: `prefetch_hold`) unless acquired,
        and with a `hold` so are those already in host. Returns how many leading keys are
        now in `tier` or on their way (a page already loading counts: loads merge).
        """
        return self._reads.prefetch(session, namespace, keys, tier, priority, hold)

    @_locked
    def stop_loads(self) -> None:
        """Withdraw every queued load (shutdown): waiting acquires return what is ready."""
        self._loads.cancel_all()

    @_locked
    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until no load is in flight (False if `timeout` seconds pass first). For
        benchmarks and tests that need a quiet store, not for the request path."""
        return self._loads.wait_idle(timeout)

    def persist(self, deadline: float | None = None) -> int:
        """Copy host-only (and device-only, through host) pages to disk at a clean stop, in
        durable batches, starting none after `deadline`; returns how many
        (kvtier.core.writes.Writes.persist says which go)."""
        return self._disk_writes.persist(self._writes.run, deadline)

    # -- write-back: the pool's thread drives it ------------------------------
    def write_back(self, reserve: int, limit: int = WRITE_BACK_BATCH) -> int:
        """Write one batch outside the lock: the dirty pages among the next `reserve` minus
        free host pages the host policy would evict (kvtier.core.writes). Returns how many
        pages it wrote (0: nothing to do, or the write failed: the pages stay dirty, and
        write-back waits for new work)."""
        return self._disk_writes.write_back(reserve, limit)

    def wait_write_back(self, timeout: float | None = None) -> bool:
        """Block until write-back may have work (a commit or a borrow since it last found
        none), or `timeout` seconds pass (False)."""
        return self._disk_writes.wait_write_back(timeout)

    def wake_write_back(self) -> None:
        """Make a `wait_write_back` in progress return now (the thread is stopping)."""
        self._disk_writes.wake_write_back()

    def wait_saved(self, timeout: float | None = None) -> bool:
        """Block until no disk write and no disk index deletion is in flight (False if
        `timeout` passes first): a load that found a rotten page deletes its entry from its
        I/O thread after waking the request. For tests and benchmarks that need a quiet store."""
        return self._disk_writes.wait_saved(timeout)

    @_locked
    def unsaved(self) -> int:
        """Cached blocks with no disk copy."""
        return self._capacity.unsaved()

    # -- leases and sessions --------------------------------------------------
    @_locked
    def release(self, session: SessionId, lease_id: LeaseId) -> None:
        """End a lease: unpin a read lease's pages, free a write lease's uncommitted pages."""
        self._release(self._leases.get(session, lease_id, None))

    @_locked
    def end_session(self, session: SessionId) -> int:
        """Release every lease of a session (closed, crashed or timed out). Returns how many."""
        leases = self._leases.of_session(session)
        for lease in leases:
            self._release(lease)
        self._loads.cancel_session(session)
        self.control.end_session(session)
        return len(leases)

    @contextmanager
    def lease_slots(self, session: SessionId, lease_id: LeaseId, kind: LeaseKind) -> Iterator[tuple[Slot, ...]]:
        """Hold the store while the caller touches a lease's pages (the gRPC slow path),
        so the lease cannot be released under it."""
        with self._lock:
            lease = self._leases.get(session, lease_id, None)
            if lease.kind is not kind:
                raise FailedPrecondition(f"lease {lease_id} is a {lease.kind.value} lease; this needs a {kind.value} lease")
            if lease.tier is not Tier.HOST:
                raise FailedPrecondition(
                    f"lease {lease_id} holds {lease.tier.label} pages; the slow path moves host pages: acquire into host"
                )
            yield tuple(lease.slots)

    def _release(self, lease: LeaseRecord) -> None:
        state = self._index.tiers[lease.tier]
        if lease.kind is LeaseKind.WRITE:
            self._index.stop_writing(lease.namespace, lease.slots)
            for slot in lease.slots:
                state.slots.free(slot)
        else:
            for ref in lease.refs:
                self._index.unpin(self._index.blocks[ref], lease.tier)
        self._leases.close(lease)
