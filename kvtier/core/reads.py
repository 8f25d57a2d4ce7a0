"""The read path: lookup, acquire (the ready prefix, lent), acquire-prefix and prefetch.

    lookup(ns, keys)       the longest cached prefix and the fastest tier of each block; with
                           a cluster tier the rest is asked of the cluster outside the lock
    acquire(ns, keys, t)   loads what is not in `t` yet (kvtier.core.loads; keys only the
                           cluster holds through kvtier.core.cluster), waits per the wait
                           policy, and lends the ready prefix: pins its copies under a lease
    acquire_prefix         lookup, then acquire of the hit prefix, under one lock where no
                           cluster is asked
    prefetch               starts loads nobody waits for; a hint, best effort
    holdings, count_group  a hybrid model's group lookup, one group at a time
                           (kvtier.core.groups): what each key holds, then the counts

`acquire` and the local prefetch run inside the write path's request loop
(kvtier.core.writes.Writes.run, passed in as `run`): making room may first need host pages
written to disk, outside the lock, and then the call runs again from the start.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from kvtier_client.errors import CapacityError, InvalidArgument, NotFound
from kvtier_client.ids import SessionId
from kvtier_client.protocol import check_lent_tier, check_prefetch, checked
from kvtier_client.tiers import Tier

from kvtier.core.cluster import ClusterCopies
from kvtier.core.index import Block, BlockIndex, check_keys, check_namespace
from kvtier.core.leases import LeaseKind, LeaseTable
from kvtier.core.loads import Loads
from kvtier.core.ports import LoadKind, Mechanism, Transfer
from kvtier.core.results import BlockState, BlockStatus, Explanation, GroupPages, PrefixMatch, ReadGrant
from kvtier.policy import Ref

T = TypeVar("T")


class Reads:
    def __init__(self, index: BlockIndex, leases: LeaseTable, loads: Loads, ports: Mechanism, lock: threading.RLock,
                 run: Callable[[Callable[[], T]], T], cluster: ClusterCopies | None) -> None:
        self.index = index
        self.leases = leases
        self.loads = loads
        self.ports = ports
        self.cluster = cluster
        self._lock = lock
        self._run = run

    # -- lookup ---------------------------------------------------------------------
    def lookup(self, namespace: str, keys: list[bytes], known: int = 0) -> PrefixMatch:
        """(kvtier.core.store.BlockStore.lookup says what.) The first `known` keys (the
        engine's own) are looked up like the rest but counted apart (`_count`)."""
        check_namespace(namespace)
        check_keys(keys)
        if self.cluster is None:
            with self._lock:
                tiers = self._lookup_local(namespace, keys)
                self._count(namespace, keys, tiers, known)
            return PrefixMatch(len(tiers), tuple(tiers))
        with self._lock:
            tiers = self._lookup_local(namespace, keys)
        found = self.cluster.present(namespace, keys[len(tiers):])
        with self._lock:
            tiers += [Tier.CLUSTER] * found
            self._count(namespace, keys, tiers, known)
        return PrefixMatch(len(tiers), tuple(tiers))

    def _lookup_local(self, namespace: str, keys: list[bytes]) -> list[Tier]:
        """The fastest tier of each block of the prefix this node holds."""
        tiers: list[Tier] = []
        blocks = self.index.blocks
        for key in keys:
            block = blocks.get((namespace, key))
            if block is None:
                break
            tiers.append(min(block.copies))  # block.best_tier, without the property call
        return tiers

    def _count(self, namespace: str, keys: list[bytes], tiers: Sequence[Tier], known: int) -> None:
        """Count one lookup that found `tiers` (its prefix): the first `known` keys as the
        engine's, the hits after them by tier, and the keys after both as misses. So
        lookup_blocks = hits + misses counts only what was asked of kvtier beyond the engine."""
        self._count_hits(namespace, tiers[known:])
        self._count_misses(namespace, keys[max(len(tiers), known):], len(keys) - known, known)

    def _count_hits(self, namespace: str, tiers: Sequence[Tier]) -> None:
        index = self.index
        usage = index.namespaces[namespace]
        for tier, n in Counter(tiers).items():
            if tier in index.tiers:  # the cluster tier counts its own (ClusterStats.found)
                index.tiers[tier].counters.hits += n
            usage.hits[tier] += n

    def _count_misses(self, namespace: str, missed: list[bytes], looked_up: int, engine: int = 0) -> None:
        """`looked_up` blocks were asked for beyond the `engine` ones the engine held, of
        which `missed` (keys) were not served."""
        index = self.index
        usage = index.namespaces[namespace]
        requests = index.requests
        requests.lookup_blocks += looked_up
        requests.miss_blocks += len(missed)
        requests.engine_blocks += engine
        usage.lookup_blocks += looked_up
        usage.miss_blocks += len(missed)
        usage.engine_blocks += engine
        if missed:
            index.count_misses(namespace, missed)

    # -- a hybrid model's groups (kvtier.core.groups) ---------------------------------
    def holdings(self, namespace: str, keys: list[bytes]) -> tuple[Tier | None, ...]:
        """(kvtier.core.store.BlockStore.holdings says what.)"""
        check_namespace(namespace)
        check_keys(keys)
        with self._lock:
            blocks = self.index.blocks
            return tuple(min(b.copies) if (b := blocks.get((namespace, key))) is not None else None for key in keys)

    def count_group(self, namespace: str, keys: list[bytes], pages: GroupPages, hit_blocks: int, known: int = 0) -> None:
        """(kvtier.core.store.BlockStore.count_group says what; kvtier.core.groups why.)"""
        hits = pages.tiers[max(0, known - pages.first_block):]  # the pages it needs beyond the engine's
        missed = keys[max(hit_blocks, known):]
        with self._lock:
            self._count_hits(namespace, hits)
            self._count_misses(namespace, missed, len(hits) + len(missed), known)

    # -- acquire --------------------------------------------------------------------
    def acquire(self, session: SessionId, namespace: str, keys: list[bytes], tier: Tier,
                timeout: float | None) -> ReadGrant:
        """(kvtier.core.store.BlockStore.acquire says what.) Runs under the lock, in `run`."""
        check_namespace(namespace)
        check_keys(keys)
        index, loads = self.index, self.loads
        if not keys:
            raise InvalidArgument("acquire needs at least one key; look up first and acquire the hit prefix")
        checked(check_lent_tier, tier, has_device=Tier.DEVICE in index.tiers)
        if len(set(keys)) != len(keys):
            raise InvalidArgument("acquire got the same key twice; pass each block once")
        if timeout is not None and timeout < 0:
            raise InvalidArgument(f"acquire timeout must be >= 0 seconds, got {timeout}")
        blocks = []
        for i, key in enumerate(keys):
            block = index.blocks.get((namespace, key))
            if block is None:
                if self.cluster is not None:
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
            return self._lend(session, namespace, blocks, tier, None, promoted=0, served={Tier.HOST: len(blocks)})
        served_from = [self._served_from(b, tier) for b in blocks] + [Tier.CLUSTER] * len(remote)
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
                from_cluster = loads.start_new(session, namespace, remote, parent, Tier.CLUSTER, LoadKind.ACQUIRE)
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
        ready = self._ready_prefix(blocks, on_device, via_host, loads.wait_ready(via_host, timeout))
        transfer = None
        try:
            if timeout is None and ready < len(blocks):
                loads.raise_not_loaded(keys, blocks, ready)
            if tier == Tier.DEVICE:
                transfer = loads.promote(namespace, blocks[:ready])
        finally:
            index.stop_waiting([b for b in via_host if index.is_current(b)], Tier.HOST)
            index.stop_waiting(on_device, Tier.DEVICE)
        return self._lend(session, namespace, blocks[:ready], tier, transfer, promoted=len(blocks) - ready_on_arrival,
                          served=Counter(served_from[:ready]))

    @staticmethod
    def _ready_prefix(blocks: list[Block], on_device: list[Block], via_host: list[Block], host_ready: int) -> int:
        """How many leading blocks are ready: device copies count as ready, host pages up to
        the first not loaded."""
        ready_ids = set(map(id, on_device)) | set(map(id, via_host[:host_ready]))
        ready = 0
        for b in blocks:
            if id(b) not in ready_ids:
                break
            ready += 1
        return ready

    @staticmethod
    def _served_from(block: Block, tier: Tier) -> Tier:
        """The tier an acquire into `tier` serves `block` from, as it stands on arrival: its
        fastest copy in place (not loading) at `tier` or below, else its fastest in place;
        CLUSTER when none is (a load from the cluster is its only copy)."""
        in_place = [t for t, copy in block.copies.items() if not copy.loading]
        return min((t for t in in_place if t >= tier), default=min(in_place, default=Tier.CLUSTER))

    def _lend(self, session: SessionId, namespace: str, blocks: list[Block], tier: Tier, transfer: Transfer | None,
              promoted: int, served: Mapping[Tier, int]) -> ReadGrant:
        """Pin the ready blocks' copies in `tier` and open the read lease on them; count them
        as served, by the tier each was in on arrival (`served`)."""
        index = self.index
        usage = index.namespaces[namespace]
        for source, n in served.items():
            index.requests.served[source] += n
            usage.served[source] += n
        policy = index.tiers[tier].policy
        for b in blocks:
            index.pin(b, tier)
            index.hold(b, tier, 0.0)  # pinned now; after release it ages like any page
            policy.touch(b.ref)
        slots = tuple(b.copies[tier].slot for b in blocks)
        lease = self.leases.open(session, namespace, LeaseKind.READ, tier, slots, [b.ref for b in blocks])
        lease.transfer = transfer
        return ReadGrant(lease.lease_id, tier, slots, promoted, len(blocks), transfer)

    def acquire_prefix(self, session: SessionId, namespace: str, keys: list[bytes], tier: Tier,
                       timeout: float | None) -> tuple[PrefixMatch, ReadGrant | None]:
        """(kvtier.core.store.BlockStore.acquire_prefix says what.)"""
        if self.cluster is not None:
            # The lookup asks the cluster outside the lock, so the two cannot share it:
            # a page evicted here meanwhile is loaded from the cluster, or missed. One the
            # cluster itself evicted meanwhile fails its load (NotFound): look up once more,
            # which now stops before it.
            for last_try in (False, True):
                match = self.lookup(namespace, keys)
                hit = min(match.hit_blocks, self.index.tiers[tier].slots.capacity) if tier in self.index.tiers else 0
                if not hit:
                    return match, None
                try:
                    return match, self._run(lambda: self.acquire(session, namespace, keys[:hit], tier, timeout))
                except NotFound:
                    if last_try:
                        raise
        matches: list[PrefixMatch] = []

        def attempt() -> tuple[PrefixMatch, ReadGrant | None]:
            if not matches:
                matches.append(self.lookup(namespace, keys))
            hit = matches[0].hit_blocks
            while hit and (namespace, keys[hit - 1]) not in self.index.blocks:  # evicted while we wrote
                hit -= 1
            if tier in self.index.tiers:
                hit = min(hit, self.index.tiers[tier].slots.capacity)
            if hit == 0:
                return matches[0], None
            return matches[0], self.acquire(session, namespace, keys[:hit], tier, timeout)

        return self._run(attempt)

    def explain(self, namespace: str, keys: list[bytes], describe: Callable[[Ref], str]) -> Explanation:
        """(kvtier.core.store.BlockStore.explain says what; `describe` gives a block's hint in words.)"""
        check_namespace(namespace)
        check_keys(keys)
        index, now = self.index, time.monotonic()
        hit = 0
        blocks = []
        for i, key in enumerate(keys):
            block = index.blocks.get((namespace, key))
            if block is not None:
                state = BlockState.CACHED if hit == i else BlockState.BEYOND_PREFIX
                hit += state is BlockState.CACHED
                blocks.append(BlockStatus(i, state, block.best_tier, hint=describe(block.ref)))
            elif (departure := index.history.departure(namespace, key)) is not None:
                blocks.append(BlockStatus(i, BlockState(departure.reason.value), departure.tier,
                                          now - departure.when, departure.policy, departure.own_pressure))
            else:
                blocks.append(BlockStatus(i, BlockState.NEVER_STORED, None))
        return Explanation(hit, tuple(blocks))

    # -- prefetch -------------------------------------------------------------------
    def prefetch(self, session: SessionId, namespace: str, keys: list[bytes], tier: Tier, priority: int,
                 hold: float = 0.0) -> int:
        """(kvtier.core.store.BlockStore.prefetch says what.)"""
        check_namespace(namespace)
        check_keys(keys)
        checked(check_prefetch, tier, priority, hold)
        accepted, complete = self._run(lambda: self._prefetch_local(session, namespace, keys, priority, hold))
        if not complete or accepted == len(keys) or self.cluster is None:
            return accepted
        rest = keys[accepted:]
        found = self.cluster.present(namespace, rest)
        if found:
            parent = keys[accepted - 1] if accepted else None
            accepted += self._run(lambda: self.cluster.prefetch(session, namespace, rest[:found], parent, priority, hold))
        return accepted

    def _prefetch_local(self, session: SessionId, namespace: str, keys: list[bytes], priority: int,
                        hold: float) -> tuple[int, bool]:
        """(leading keys accepted, whether it stopped only because a key is not cached here).
        With `hold`, pages already in host are held that long too, and loaded ones once loaded."""
        room = self.ports.disk.prefetch_room() if self.ports.disk is not None else 0
        until = time.monotonic() + hold
        accepted = 0
        for key in keys:
            block = self.index.blocks.get((namespace, key))
            if block is None:
                return accepted, True
            if Tier.HOST not in block.copies:
                if room == 0:
                    break
                try:
                    self.loads.start(session, namespace, [block], Tier.HOST, LoadKind.PREFETCH, priority)
                except CapacityError:
                    break
                block.copies[Tier.HOST].waiters -= 1  # nobody waits: the hold protects it once loaded
                room -= 1
            copy = block.copies[Tier.HOST]
            if hold and copy.job is not None:
                copy.job.hold = max(copy.job.hold, hold)
            elif hold and not copy.loading and copy.held_until < until:
                self.index.hold(block, Tier.HOST, until)
            accepted += 1
        return accepted, False
