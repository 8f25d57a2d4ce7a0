"""The block store: the one owner of residency state for one page layout, behind one lock.

Every slot of every tier is exactly one of

    free     in the tier's SlotAllocator
    writing  held by a write lease (borrowed, not yet committed)
    cached   holding a copy of a block; may be pinned by read leases, or still loading

and the three counts add up to the tier's capacity (kvtier.core.invariants checks it).

This module is the façade: it validates a request, takes the lock and walks the request
through the parts, each a module of its own:

    index.py     blocks, copies, tier states and counters (BlockIndex)
    leases.py    leases and the sessions holding them (LeaseTable)
    capacity.py  make room: the policy proposes victims, evictions demote or drop
    writes.py    disk writes outside the lock: eviction write-outs, write-through, cleaning
    loads.py     disk -> host loads, host -> device promotions, waiting for them
    quotas.py    per-namespace quotas, and the victim picker that keeps their guarantees
    history.py   blocks that left the index, so a miss can say why
    results.py   what the calls return (PrefixMatch, WriteGrant, ReadGrant, ...)
    ports.py     what the core needs from mechanism (PageMover, LoadJob, PageRecord, Transfer)
    slots.py     a tier's free slots (SlotAllocator)
    bookkeeping.py  a mover with no bytes, for replay and tests

The engine's path to a page, in four hops:

    borrow(n)    -> capacity.make_room(HOST, n) -> policy.victims -> evict (demote / drop)
                 -> n host slots, leased for writing
    commit(keys) -> each slot becomes a cached copy of its key (or is freed as a duplicate)
    acquire(keys, HOST) -> loads.start: a loading host copy per disk-only block, read by
                 the mover's I/O workers; waits per the wait policy, then pins the ready prefix
    release      -> unpins (read) or frees what was never committed (write)

On a GPU daemon a device tier sits above host. `acquire(keys, DEVICE)` first brings every
page without a device copy into host exactly as above, then promotes the ready prefix
host -> device in one copy-engine submission and returns at once: the lease carries the
submission's interprocess CUDA event, which the engine waits on before reading. Evicting a
device page demotes it to host when host has no copy, and host evictions go on to disk.

With a cluster tier (a store shared by nodes, below disk), a lookup whose prefix ends
here asks the cluster for the rest, outside the lock, and reports its hits as CLUSTER;
`acquire` and `prefetch` file a new block per such key with a loading host copy and load
it through the same path as a disk page (`Loads.start_remote`). Committed pages are handed
to the mover's cluster writer with their host copies held until it reports
(`cluster_write = commit`), or copied as they are demoted to disk (`demote`).

Capacity failures are decided before anything changes: `victims` only proposes, so a
request that cannot be met raises CapacityError with every structure untouched.

No disk I/O runs under the lock on the request path. A request that must evict dirty host
pages gets `WriteOut` from capacity: the lock is released, the pages are written (still
cached, readable and acquirable, but protected), the lock retaken, the disk copies filed,
and the request runs again from the start (`_run`); it then evicts them with no write.
Disk index deletions queued under the lock are handed to the mover after releasing it.
A write-through commit writes its pages the same way, after releasing the lock; cleaning
runs on the pool's write-back thread (`write_back`).
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import wraps
from typing import TypeVar

from kvtier_client.errors import CapacityError, FailedPrecondition, InvalidArgument, NotFound
from kvtier_client.ids import LeaseId, SessionId, Slot
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.core.capacity import Capacity
from kvtier.core.history import DEFAULT_HISTORY_SIZE
from kvtier.core.index import (
    Block, BlockIndex, Copy, NamespaceCounters, TierCounters, TierState, check_keys, check_namespace,
)
from kvtier.core.leases import LeaseKind, LeaseRecord, LeaseTable
from kvtier.core.loads import Loads
from kvtier.core.ports import BlockEvents, LoadKind, PageMover, PageRecord, Transfer
from kvtier.core.quotas import NO_QUOTA, Quota, check_quotas
from kvtier.core.results import (
    BlockState, BlockStatus, CommitOutcome, Explanation, NamespaceTierUsage, NamespaceUsage, PrefixMatch, ReadGrant,
    StoreUsage, TierUsage, WriteGrant,
)
from kvtier.core.slots import SlotAllocator
from kvtier.core.writes import WRITE_BACK_BATCH, ClusterWrite, WriteBack, WriteBatch, WriteOut
from kvtier.policy import Admission, EvictionPolicy, LRUPolicy, Ref, Watched

T = TypeVar("T")

def _locked(method):
    @wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


def _restartable(method):
    """A request that may need pages written to disk before it can evict them: run it
    with `_run`, so the writes happen outside the lock."""
    @wraps(method)
    def wrapper(self, *args, **kwargs):
        return self._run(lambda: method(self, *args, **kwargs))

    return wrapper


class BlockStore:
    """Index, leases and sessions for one layout's host tier and optional device and disk tiers.

    `policy` makes one eviction policy object per tier from its page count (a policy class will do).
    `admission` decides which host pages leaving host are written to disk (default: all;
    pages committed write-through and the stop-time copy are always written).
    `recovered` is the disk tier's persisted index, filed as cached disk pages;
    `recovered_host` the host pages adopted from a crashed daemon's arena (`host_reused`:
    that arena's other slots may hold anyone's bytes). `history_size`: blocks that left
    the index remembered (all namespaces together), to explain misses. `cluster`: the mover has a
    cluster tier (`cluster_write`: when pages are copied to it).
    """

    def __init__(
        self,
        layout: PageLayout,
        *,
        host_pages: int,
        mover: PageMover,
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
        cluster: bool = False,
        cluster_write: ClusterWrite = ClusterWrite.OFF,
    ) -> None:
        if host_pages <= 0:
            raise ValueError("the host tier needs at least one page: it is where engines read and write pages")
        self.layout = layout
        self.write_through = write_through
        #: A cluster tier below the others: lookups, acquires and prefetches go on to it
        #: for keys this node does not hold, and pages are copied to it per `cluster_write`.
        self.cluster = cluster
        self.cluster_write = cluster_write if cluster else ClusterWrite.OFF
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
            tiers.append(TierState(Tier.DISK, SlotAllocator(disk_pages, used=[r.slot for r in records]), policy(disk_pages)))
        self._lock = threading.RLock()
        self._index = BlockIndex(tiers, host_reused=host_reused, history_size=history_size)
        if disk_pages > 0:
            self._index.recover_disk(records)
        self._index.recover_host(adopted)
        self._leases = LeaseTable()
        self._capacity = Capacity(self._index, mover, layout, admission)
        self._loads = Loads(self._index, self._capacity, mover, layout, self._lock, prefetch_hold)
        self._writeback = WriteBack(self._index, self._capacity)
        #: Notified when write-back may have work (a commit or a borrow); `wait_write_back`.
        self._wanted = threading.Condition(self._lock)
        self._mover = mover

    # -- running requests: disk I/O outside the lock --------------------------
    def _run(self, call: Callable[[], T]) -> T:
        """Run `call` under the lock. When it raises WriteOut, write (or wait for) the pages
        with the lock released, then run it again from the start: each round writes pages
        it did not try before (capacity's `restartable` set), so it ends. Index deletions
        queued meanwhile go to the mover after the lock is released. A call nested in one
        of ours (the lock already held) is run by the outermost one."""
        lock = self._lock
        if lock._is_owned():
            return call()
        tried: set[Ref] = set()
        while True:
            batch = None
            with lock:
                self._capacity.restartable = tried
                try:
                    return call()
                except WriteOut as pending:
                    batch = pending.batch
                    saved, saving = pending.saved, self._capacity.saving
                    if saved:  # someone else is writing them: wait for that to land
                        self._loads.loaded.wait_for(lambda: not any(b.ref in saving for b in saved))
                finally:
                    self._capacity.restartable = None
                    forgets = self._capacity.take_forgets()
                    staged = self._capacity.take_staged()
                    if forgets or staged or batch is not None:
                        lock.release()  # the I/O goes outside the lock; `with` takes it back to leave
                        try:
                            self._mover.publish_host(staged)
                            self._loads.forget(forgets)
                            if batch is not None:
                                self._write(batch)
                        finally:
                            lock.acquire()

    def _write(self, batch: WriteBatch) -> bool:
        """Store a prepared batch outside the lock, then file it under the lock. False if
        the store failed (OSError). With `cluster_write = demote` the pages not yet in the
        cluster are copied for it too, while the batch still protects them."""
        stored = None
        try:
            stored = self._mover.store(batch.moves)
            if self.cluster_write is ClusterWrite.DEMOTE:
                self._demote_to_cluster(batch)
        except OSError:
            pass  # `file` counts it; the mechanism logs the fault
        finally:
            with self._lock:
                self._capacity.file(batch, stored)
                self._loads.loaded.notify_all()
        return stored is not None

    def _want_write_back(self) -> None:
        if not self._writeback.wanted:
            self._writeback.wanted = True
            self._wanted.notify_all()

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

    @property
    def events(self) -> BlockEvents | None:
        """Told of every copy that arrives in or leaves a tier (KV events); None by default."""
        return self._index.events

    @events.setter
    def events(self, sink: BlockEvents | None) -> None:
        """Set the sink and tell it of every copy already in place (pages recovered from
        disk or adopted from a crashed daemon), so a listener starts from the whole state."""
        with self._lock:
            self._index.events = sink
            if sink is not None:
                for block in self._index.blocks.values():
                    for tier, copy in block.copies.items():
                        if not copy.loading:
                            self._index.announce(block, tier)

    @property
    def forgetting(self) -> set[PageRecord]:
        """Disk pages dropped from the index whose entries in the disk tier's own index are
        being deleted, outside the lock (a worker that just dropped a corrupt page)."""
        return self._capacity.forgetting

    @property
    def saving(self) -> dict[Ref, PageRecord]:
        """Disk writes in flight: each saved block and the record it will be filed with."""
        return self._capacity.saving

    # -- queries --------------------------------------------------------------
    def lookup(self, namespace: str, keys: list[bytes]) -> PrefixMatch:
        """The longest cached prefix of `keys` and the fastest tier of each of its blocks;
        why each key after it missed is counted for the namespace. With a cluster tier, the
        keys after this node's prefix are asked of the cluster in one batch, outside the
        lock: its leading hits extend the prefix as CLUSTER."""
        check_namespace(namespace)
        check_keys(keys)
        if not self.cluster:
            with self._lock:
                tiers = self._lookup_local(namespace, keys)
                self._count_misses(namespace, keys, len(tiers))
            return PrefixMatch(len(tiers), tuple(tiers))
        with self._lock:
            tiers = self._lookup_local(namespace, keys)
        found = self._mover.remote_present(namespace, keys[len(tiers):]) if len(tiers) < len(keys) else 0
        with self._lock:
            self._index.namespaces[namespace].hits[Tier.CLUSTER] += found
            tiers += [Tier.CLUSTER] * found
            self._count_misses(namespace, keys, len(tiers))
        return PrefixMatch(len(tiers), tuple(tiers))

    def _lookup_local(self, namespace: str, keys: list[bytes]) -> list[Tier]:
        """The fastest tier of each block of the prefix this node holds; counts the hits."""
        index = self._index
        tiers: list[Tier] = []
        blocks = index.blocks
        for key in keys:
            block = blocks.get((namespace, key))
            if block is None:
                break
            tiers.append(min(block.copies))  # block.best_tier, without the property call
        usage = index.namespaces[namespace]
        for tier, n in Counter(tiers).items():
            index.tiers[tier].counters.hits += n
            usage.hits[tier] += n
        return tiers

    def _count_misses(self, namespace: str, keys: list[bytes], hit: int) -> None:
        index = self._index
        usage = index.namespaces[namespace]
        missed = len(keys) - hit
        requests = index.requests
        requests.lookup_blocks += len(keys)
        requests.miss_blocks += missed
        usage.lookup_blocks += len(keys)
        usage.miss_blocks += missed
        if missed:
            index.count_misses(namespace, keys[hit:])

    @_locked
    def explain(self, namespace: str, keys: list[bytes]) -> Explanation:
        """What a lookup of `keys` would find, key by key, and for a key not found whether
        it is cached beyond the prefix, left the index (when, why, chosen by which policy)
        or was never stored. Changes no counter and no recency."""
        check_namespace(namespace)
        check_keys(keys)
        index, now = self._index, time.monotonic()
        hit = 0
        blocks = []
        for i, key in enumerate(keys):
            block = index.blocks.get((namespace, key))
            if block is not None and hit == i:
                hit += 1
                blocks.append(BlockStatus(i, BlockState.CACHED, block.best_tier))
            elif block is not None:
                blocks.append(BlockStatus(i, BlockState.BEYOND_PREFIX, block.best_tier))
            elif (departure := index.history.departure(namespace, key)) is not None:
                blocks.append(BlockStatus(i, BlockState(departure.reason.value), departure.tier,
                                          now - departure.when, departure.policy, departure.own_pressure))
            else:
                blocks.append(BlockStatus(i, BlockState.NEVER_STORED, None))
        return Explanation(hit, tuple(blocks))

    @_locked
    def stats(self) -> StoreUsage:
        now = time.monotonic()
        tiers = [
            TierUsage(state.tier, state.slots.capacity, state.slots.free_count, len(state.writing), state.cached,
                      *state.breakdown(self._index.blocks, now), TierCounters(**vars(state.counters)))
            for state in self._index.tiers.values()
        ]
        r = self._index.requests
        namespaces = self._index.namespaces
        by_namespace = tuple(self._namespace_usage(ns, namespaces[ns]) for ns in sorted(namespaces))
        return StoreUsage(
            tuple(tiers), r.lookup_blocks, r.miss_blocks, len(self._leases.leases), len(self._leases.sessions),
            r.acquired_pages, r.ready_on_arrival, r.loads_in_flight, by_namespace,
            len(self._index.history), self._index.history.size, self._index.history.estimated_bytes,
        )

    def _namespace_usage(self, namespace: str, counters: NamespaceCounters) -> NamespaceUsage:
        quota = self._capacity.quotas.get(namespace, NO_QUOTA)
        tiers = tuple(
            NamespaceTierUsage(tier, counters.pages[tier], quota.max_pages(tier), quota.guaranteed_pages(tier),
                               counters.hits[tier], counters.evictions[tier])
            for tier in self._index.tiers
        )
        misses = {reason.value: n for reason, n in counters.misses.items()}
        return NamespaceUsage(namespace, tiers, counters.lookup_blocks, counters.miss_blocks, misses)

    @_locked
    def set_quotas(self, quotas: Mapping[str, Quota]) -> None:
        """Replace every namespace's quota (a namespace not in `quotas` has none). Raises
        ValueError, keeping the old quotas, if they cannot all be kept in this store's
        tiers. Evicts nothing now: they apply from each namespace's next allocation."""
        check_quotas(quotas, {tier: state.slots.capacity for tier, state in self._index.tiers.items()})
        self._capacity.quotas = {ns: quota for ns, quota in quotas.items() if quota != NO_QUOTA}

    @_locked
    def session_leases(self, session: SessionId) -> int:
        """How many leases a session holds in this store (Heartbeat reports it)."""
        return len(self._leases.sessions.get(session, ()))

    # -- write path -----------------------------------------------------------
    def borrow(self, session: SessionId, namespace: str, n: int) -> WriteGrant:
        """A write lease on n free host pages, evicting or demoting cached pages if needed.
        Slots that change holder are populated after the lock is released."""
        grant, given = self._run(lambda: self._borrow(session, namespace, n))
        if given:
            self._mover.populate_host(given, namespace)
        return grant

    def _borrow(self, session: SessionId, namespace: str, n: int) -> tuple[WriteGrant, list[Slot]]:
        check_namespace(namespace)
        host = self._index.tiers[Tier.HOST]
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise InvalidArgument(f"borrow needs a positive page count, got {n!r}")
        if n > host.slots.capacity:
            raise InvalidArgument(
                f"borrow of {n} pages exceeds the host tier's {host.slots.capacity} pages; borrow in smaller batches"
            )
        self._capacity.make_room(Tier.HOST, n, namespace)
        slots, given = self._capacity.take_host_slots(namespace, n)
        self._index.start_writing(namespace, slots)
        lease = self._leases.open(session, namespace, LeaseKind.WRITE, Tier.HOST, slots)
        self._want_write_back()  # the clean reserve may be short now
        return WriteGrant(lease.lease_id, Tier.HOST, tuple(slots)), given

    def commit(self, session: SessionId, lease_id: LeaseId, keys: list[bytes], parent: bytes | None = None,
               tokens: list[tuple[int, ...]] | None = None) -> CommitOutcome:
        """Publish a write lease's pages: page i becomes the cached copy of keys[i].

        `parent` is the key of the block before keys[0] in its prefix, if there is one. Pages
        beyond len(keys) are freed. The lease ends. With write-through, the new pages are
        written to disk in one batch after the lock is released, before this returns: they
        are hits (and protected) meanwhile, and on disk when the engine hears back.
        `tokens`, when given, are each key's block of token ids (`block_tokens` each): kvtier
        never reads them, it only carries them in its KV events for routers that hash tokens.
        """
        if tokens is not None:
            self._check_tokens(keys, tokens)
        with self._lock:
            outcome, fresh, staged = self._commit(session, lease_id, keys, parent, tokens)
            batch = self._capacity.prepare(fresh) if fresh and self.write_through and Tier.DISK in self._index.tiers else None
            forgets = self._capacity.take_forgets()
            to_cluster = fresh and self.cluster_write is ClusterWrite.COMMIT
            if to_cluster:
                for b in fresh:  # the host slots stay put until the cluster write is done
                    b.copies[Tier.HOST].readers += 1
        self._mover.publish_host(staged)  # hashed here, outside the lock, before the engine hears back
        self._loads.forget(forgets)
        if to_cluster:
            self._write_cluster(fresh)
        if batch:
            self._write(batch)
        return outcome

    def _write_cluster(self, blocks: list[Block]) -> None:
        """Hand committed pages (their host copies protected by a reader each) to the
        cluster writer; they are released when it is done, or now if it refuses them."""
        namespace = blocks[0].ref[0]
        pages = [(b.ref[1], b.copies[Tier.HOST].slot) for b in blocks]
        if not self._mover.remote_write(namespace, pages, lambda results: self._cluster_written(blocks, results)):
            self._cluster_written(blocks, [False] * len(blocks))

    def _demote_to_cluster(self, batch: WriteBatch) -> None:
        """Offer a disk batch's pages that the cluster lacks to its writer, as copies (the
        batch protects the host slots only until it is filed)."""
        by_namespace: dict[str, list[Block]] = {}
        with self._lock:
            for block, _ in batch.entries:
                if not block.in_cluster:
                    by_namespace.setdefault(block.ref[0], []).append(block)
            pages = {ns: [(b.ref[1], b.copies[Tier.HOST].slot) for b in blocks] for ns, blocks in by_namespace.items()}
        for namespace, blocks in by_namespace.items():
            self._mover.remote_write(namespace, pages[namespace], lambda results, blocks=blocks:
                                     self._cluster_written(blocks, results, held=False), copy=True)

    def _cluster_written(self, blocks: list[Block], results: list[bool], held: bool = True) -> None:
        with self._lock:
            events = self._index.events
            for b, ok in zip(blocks, results):
                if held:  # a commit's pages: their host copies were kept for the writer
                    b.copies[Tier.HOST].readers -= 1
                b.in_cluster = b.in_cluster or ok
                if ok and events is not None:
                    namespace, key = b.ref
                    events.stored(Tier.CLUSTER, namespace, key, b.parent[1] if b.parent else None, b.tokens)
            self._loads.loaded.notify_all()

    def _check_tokens(self, keys: list[bytes], tokens: list[tuple[int, ...]]) -> None:
        per_block = self.layout.block_tokens
        if len(tokens) != len(keys):
            raise InvalidArgument(f"commit got token ids for {len(tokens)} blocks and {len(keys)} keys; pass one block of "
                                  "token ids per key, or none")
        for i, block in enumerate(tokens):
            if len(block) != per_block:
                raise InvalidArgument(f"block {i} has {len(block)} token ids; a page holds {per_block} tokens")

    def _commit(self, session: SessionId, lease_id: LeaseId, keys: list[bytes], parent: bytes | None,
                tokens: list[tuple[int, ...]] | None = None) -> tuple[CommitOutcome, list[Block], list[PageRecord]]:
        lease = self._leases.get(session, lease_id, LeaseKind.WRITE)
        check_keys(keys)
        if parent is not None:
            check_keys([parent])
            if parent in keys:
                # A block cannot follow itself: the cycle has no hash-chain meaning, and the
                # prefix policy would never see the block as a leaf (never evictable).
                raise InvalidArgument(
                    f"parent key {parent.hex()} is also one of the keys committed after it; "
                    "pass the key of the block before keys[0]"
                )
        if len(keys) > len(lease.slots):
            raise InvalidArgument(
                f"commit of {len(keys)} keys to lease {lease_id} which holds {len(lease.slots)} pages; "
                "borrow enough pages first"
            )
        index = self._index
        host = index.tiers[Tier.HOST]
        ns = lease.namespace
        prev: Ref | None = (ns, parent) if parent is not None else None
        duplicates: list[int] = []
        fresh: list[Block] = []
        index.stop_writing(ns, lease.slots)
        for i, (slot, key) in enumerate(zip(lease.slots, keys)):
            ref = (ns, key)
            existing = index.blocks.get(ref)
            if existing is not None:
                duplicates.append(i)
                host.slots.free(slot)
                if Tier.HOST in existing.copies:
                    host.policy.touch(ref)
            else:
                fresh.append(index.add_block(ref, prev, Tier.HOST, Copy(slot), tokens[i] if tokens else None))
            prev = ref
        for slot in lease.slots[len(keys) :]:
            host.slots.free(slot)
        self._leases.close(lease)
        staged = self._mover.stage_host([b.entry(Tier.HOST) for b in fresh])
        self._want_write_back()  # new dirty pages: the clean reserve may need them later
        return CommitOutcome(lease_id, len(fresh), tuple(duplicates)), fresh, staged

    # -- read path ------------------------------------------------------------
    @_restartable
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
        check_namespace(namespace)
        check_keys(keys)
        index, loads = self._index, self._loads
        if not keys:
            raise InvalidArgument("acquire needs at least one key; look up first and acquire the hit prefix")
        if tier not in index.tiers or tier == Tier.DISK:
            lendable = " and ".join(t.label for t in index.tiers if t != Tier.DISK)
            raise InvalidArgument(f"acquire into {tier.label} is not available: this daemon lends {lendable} pages")
        if len(set(keys)) != len(keys):
            raise InvalidArgument("acquire got the same key twice; pass each block once")
        if timeout is not None and timeout < 0:
            raise InvalidArgument(f"acquire timeout must be >= 0 seconds, got {timeout}")
        blocks = []
        for i, key in enumerate(keys):
            block = index.blocks.get((namespace, key))
            if block is None:
                if self.cluster:
                    break  # keys[i:] come from the cluster tier
                raise NotFound(f"key {i} ({key.hex()}) is not cached; look up again and acquire only the hit prefix")
            blocks.append(block)
        remote = keys[len(blocks):]
        # The cluster's part ends where this node holds a key again (that block is ours).
        remote = remote[:next((j for j, key in enumerate(remote) if (namespace, key) in index.blocks), len(remote))]
        state = index.tiers[tier]
        if len(keys) > state.slots.capacity:
            raise InvalidArgument(f"acquire of {len(keys)} pages exceeds the {tier.label} tier's {state.slots.capacity}")
        if not remote and tier == Tier.HOST and all((c := b.copies.get(Tier.HOST)) is not None and not c.loading for b in blocks):
            # Every page is in host already (the common case): nothing to load or wait for.
            index.requests.acquired_pages += len(blocks)
            index.requests.ready_on_arrival += len(blocks)
            return self._lend(session, namespace, blocks, tier, None, promoted=0)
        # Device copies already there are kept (as waiters) while the rest reach host.
        on_device = [b for b in blocks if tier == Tier.DEVICE and Tier.DEVICE in b.copies]
        index.wait_on(on_device, Tier.DEVICE)
        via_host = [b for b in blocks if tier == Tier.HOST or Tier.DEVICE not in b.copies]
        try:
            loads.start(session, namespace, via_host, Tier.HOST, LoadKind.ACQUIRE)
        except BaseException:  # CapacityError, or WriteOut: run again from the start
            index.stop_waiting(on_device, Tier.DEVICE)
            raise
        if remote:
            parent = keys[len(blocks) - 1] if blocks else None
            try:
                from_cluster = loads.start_remote(session, namespace, remote, parent, LoadKind.ACQUIRE)
            except BaseException:
                index.stop_waiting(via_host, Tier.HOST)
                index.stop_waiting(on_device, Tier.DEVICE)
                raise
            blocks += from_cluster
            via_host += from_cluster
        # (A load that failed at once, its copy dropped, was not ready.)
        ready_on_arrival = len(on_device) + sum(
            1 for b in via_host if Tier.HOST in b.copies and not b.copies[Tier.HOST].loading
        )
        index.requests.acquired_pages += len(blocks)
        index.requests.ready_on_arrival += ready_on_arrival
        host_ready = loads.wait_ready(via_host, timeout)
        # The ready prefix: device copies count as ready, host pages up to the first not loaded.
        ready_ids = set(map(id, on_device)) | set(map(id, via_host[:host_ready]))
        ready = 0
        for b in blocks:
            if id(b) not in ready_ids:
                break
            ready += 1
        transfer = None
        try:
            if timeout is None and ready < len(blocks):
                loads.raise_not_loaded(keys, blocks, ready)
            if tier == Tier.DEVICE:
                transfer = loads.promote(namespace, blocks[:ready])
        finally:
            index.stop_waiting([b for b in via_host if index.is_current(b)], Tier.HOST)
            index.stop_waiting(on_device, Tier.DEVICE)
        return self._lend(session, namespace, blocks[:ready], tier, transfer, promoted=len(blocks) - ready_on_arrival)

    def _lend(self, session: SessionId, namespace: str, blocks: list[Block], tier: Tier, transfer: Transfer | None,
              promoted: int) -> ReadGrant:
        """Pin the ready blocks' copies in `tier` and open the read lease on them."""
        index = self._index
        policy = index.tiers[tier].policy
        for b in blocks:
            index.pin(b, tier)
            index.hold(b, tier, 0.0)  # pinned now; after release it ages like any page
            policy.touch(b.ref)
        slots = tuple(b.copies[tier].slot for b in blocks)
        lease = self._leases.open(session, namespace, LeaseKind.READ, tier, slots, [b.ref for b in blocks])
        lease.transfer = transfer
        return ReadGrant(lease.lease_id, tier, slots, promoted, len(blocks), transfer)

    def acquire_prefix(
        self, session: SessionId, namespace: str, keys: list[bytes], tier: Tier = Tier.HOST,
        timeout: float | None = None,
    ) -> tuple[PrefixMatch, ReadGrant | None]:
        """Lookup and acquire in one call: the longest cached prefix of `keys` (at most the
        tier's capacity), acquired as `acquire` would with `timeout`. Under one lock, so no
        eviction falls between the two; the grant is None when nothing is cached. (When the
        acquire must first write pages to disk, it runs again on what is still cached then,
        the lookup counted once.)"""
        if self.cluster:
            # The lookup asks the cluster outside the lock, so the two cannot share it:
            # a page evicted here meanwhile is loaded from the cluster, or missed. One the
            # cluster itself evicted meanwhile fails its load (NotFound): look up once more,
            # which now stops before it.
            for last_try in (False, True):
                match = self.lookup(namespace, keys)
                hit = min(match.hit_blocks, self._index.tiers[tier].slots.capacity) if tier in self._index.tiers else 0
                if not hit:
                    return match, None
                try:
                    return match, self.acquire(session, namespace, keys[:hit], tier, timeout)
                except NotFound:
                    if last_try:
                        raise
        matches: list[PrefixMatch] = []

        def attempt() -> tuple[PrefixMatch, ReadGrant | None]:
            if not matches:
                matches.append(self.lookup(namespace, keys))
            hit = matches[0].hit_blocks
            while hit and (namespace, keys[hit - 1]) not in self._index.blocks:  # evicted while we wrote
                hit -= 1
            if tier in self._index.tiers:
                hit = min(hit, self._index.tiers[tier].slots.capacity)
            if hit == 0:
                return matches[0], None
            return matches[0], self.acquire(session, namespace, keys[:hit], tier, timeout)

        return self._run(attempt)

    def prefetch(
        self, session: SessionId, namespace: str, keys: list[bytes], tier: Tier = Tier.HOST, priority: int = 0
    ) -> int:
        """Start loading the disk-only pages of `keys` into `tier` (and, with a cluster tier,
        the pages after this node's prefix that the cluster holds); returns at once.

        A hint, best effort: it stops at the first key that is not cached, when the
        prefetch queue is full (back-pressure) or when no room can be made. A loaded page is
        held for `prefetch_hold` seconds unless acquired. Returns how many leading keys are
        now in `tier` or on their way (a page already loading counts: loads merge).
        """
        check_namespace(namespace)
        check_keys(keys)
        if tier != Tier.HOST:
            raise InvalidArgument(
                f"prefetch into {tier.label} is not available: prefetch loads pages into host; "
                "acquire into device promotes them from there"
            )
        accepted, complete = self._run(lambda: self._prefetch_local(session, namespace, keys, priority))
        if not complete or accepted == len(keys) or not self.cluster:
            return accepted
        rest = keys[accepted:]
        found = self._mover.remote_present(namespace, rest)
        if found:
            parent = keys[accepted - 1] if accepted else None
            accepted += self._run(lambda: self._prefetch_remote(session, namespace, rest[:found], parent, priority))
        return accepted

    def _prefetch_local(self, session: SessionId, namespace: str, keys: list[bytes], priority: int) -> tuple[int, bool]:
        """(leading keys accepted, whether it stopped only because a key is not cached here)."""
        room = self._mover.prefetch_room(Tier.DISK)
        accepted = 0
        for key in keys:
            block = self._index.blocks.get((namespace, key))
            if block is None:
                return accepted, True
            if Tier.HOST not in block.copies:
                if room == 0:
                    break
                try:
                    self._loads.start(session, namespace, [block], Tier.HOST, LoadKind.PREFETCH, priority)
                except CapacityError:
                    break
                block.copies[Tier.HOST].waiters -= 1  # nobody waits: the hold protects it once loaded
                room -= 1
            accepted += 1
        return accepted, False

    def _prefetch_remote(self, session: SessionId, namespace: str, keys: list[bytes], parent: bytes | None,
                         priority: int) -> int:
        """Prefetch keys the cluster holds, up to the first one this node has meanwhile."""
        room = self._mover.prefetch_room(Tier.CLUSTER)
        keys = keys[:room]
        keys = keys[:next((i for i, key in enumerate(keys) if (namespace, key) in self._index.blocks), len(keys))]
        if not keys:
            return 0
        try:
            blocks = self._loads.start_remote(session, namespace, keys, parent, LoadKind.PREFETCH, priority)
        except CapacityError:
            return 0
        self._index.stop_waiting(blocks, Tier.HOST)  # nobody waits: the hold protects them once loaded
        return len(blocks)

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
        (kvtier.core.capacity.Capacity.persist says which go). Writes under the lock: the
        daemon has stopped serving by then."""
        with self._lock:
            saved = self._capacity.persist(deadline)
            forgets = self._capacity.take_forgets()
        self._loads.forget(forgets)
        return saved

    # -- write-back: the pool's thread drives it ------------------------------
    def write_back(self, reserve: int, limit: int = WRITE_BACK_BATCH) -> int:
        """Write one batch outside the lock: the dirty pages among the next `reserve` minus
        free host pages the host policy would evict (kvtier.core.writes). Returns how many pages it wrote (0: nothing to do, or the
        write failed: the pages stay dirty, and write-back waits for new work)."""
        with self._lock:
            batch = self._writeback.next_batch(reserve, limit)
            forgets = self._capacity.take_forgets()
        self._loads.forget(forgets)
        if batch is None:
            return 0
        if self._write(batch):
            return len(batch)
        with self._lock:
            self._writeback.wanted = False  # a failing disk: try again when new work comes
        return 0

    def wait_write_back(self, timeout: float | None = None) -> bool:
        """Block until write-back may have work (a commit or a borrow since it last found
        none), or `timeout` seconds pass (False)."""
        with self._lock:
            return self._wanted.wait_for(lambda: self._writeback.wanted, timeout)

    def wake_write_back(self) -> None:
        """Make a `wait_write_back` in progress return now (the thread is stopping)."""
        with self._lock:
            self._writeback.wanted = True
            self._wanted.notify_all()

    def wait_saved(self, timeout: float | None = None) -> bool:
        """Block until no disk write is in flight (False if `timeout` passes first). For
        tests and benchmarks that need a quiet store."""
        with self._lock:
            return self._loads.loaded.wait_for(lambda: not self._capacity.saving, timeout)

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
