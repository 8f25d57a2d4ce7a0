"""The store's invariants, checked from the outside. Tests run this after every step; an
operator can run it through `kvtier` debugging tools. A violation is a bug, never a user error.

1. Every slot of every tier is exactly one of free, writing (write-leased) or cached.
2. free + writing + cached == capacity, per tier.
3. No two blocks share a slot; every block has at least one copy.
4. The policy tracks exactly the tier's cached copies.
5. Pins equal the read leases that hold each copy; write-leased slots equal the write leases'.
   A host copy still loading has a disk copy to read from and is never leased; a device
   copy still loading has a protected host copy (and may be leased: the engine waits on
   the lease's CUDA event). A host copy being saved (written to disk outside the lock)
   has no disk copy yet, and its disk slot is a `writing` disk slot: the disk's writing
   slots are exactly those of the writes in flight, one per saved copy.
6. Every lease belongs to its session's set and nothing else does.
7. The disk tier's persistent index (LMDB) names exactly the disk copies, at the same slots.
8. Stats add up: per tier, free + writing + cached == capacity, and pinned + loading + held
   + idle == cached with none negative; the tier's set of loading copies is exactly the
   copies marked loading.
9. Namespaces add up: each namespace's pages in a tier are its copies there plus its
   writing slots (host: write leases; disk: writes in flight), and the namespaces' pages
   sum to the tier's cached plus writing pages.
10. Every disk chunk is exactly one of free, reserved by a write in flight, or in one disk
   copy's extent; the disk's stored bytes are its copies' stored lengths.
11. Hints name cached blocks only; their counts (by class, namespace and session) are the
   table's; no namespace hard-pins more blocks than its guaranteed host pages. (That a
   hard-pinned host copy is never evicted is checked step by step: tests/core/test_store_hints.py.)

Two quota rules hold only under conditions the store cannot see, so they are checked
apart: `check_quotas_kept` (no namespace above its maximum; true after every step unless
quotas were lowered since the namespace last allocated) and `check_guarantees_kept` (a
request of one namespace took no other below its guarantee, given usage before and after).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvtier_client.tiers import Tier

from kvtier.core.chunks import chunks_in
from kvtier.core.leases import LeaseKind
from kvtier.core.ports import PageRecord
from kvtier.core.results import StoreUsage
from kvtier.core.store import BlockStore


class InvariantViolation(AssertionError):
    pass


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantViolation(message)


def check_invariants(store: BlockStore, disk_records: Iterable[PageRecord] | None = None) -> None:
    """Raise InvariantViolation naming the first broken rule. `disk_records` is the disk
    tier's persisted index (DiskTier.records()); pass it to check rule 7."""
    for ref, block in store.blocks.items():
        _require(block.ref == ref, f"block filed under {ref} calls itself {block.ref}")
        _require(bool(block.copies), f"block {ref} has no copy in any tier")

    pins: Counter[tuple[Tier, tuple]] = Counter()
    writing: dict[Tier, set[int]] = {t: set() for t in store.tiers}
    saving = store.saving
    for ref, record in saving.items():
        block = store.blocks.get(ref)
        _require(block is not None and Tier.HOST in block.copies and block.copies[Tier.HOST].saved,
                 f"a disk write of {ref} is in flight without a saved host copy")
        _require(Tier.DISK not in block.copies, f"{ref} is being saved to disk but already has a disk copy")
        _require(record.slot not in writing[Tier.DISK], f"disk slot {record.slot} is written for two blocks")
        writing[Tier.DISK].add(record.slot)
    saved = {ref for ref, b in store.blocks.items() if Tier.HOST in b.copies and b.copies[Tier.HOST].saved}
    _require(saved == saving.keys(), f"saved host copies {sorted(saved ^ saving.keys())[:3]} have no disk write in flight")
    for lease_id, lease in store.leases.items():
        _require(lease.lease_id == lease_id, f"lease filed under {lease_id} calls itself {lease.lease_id}")
        _require(lease_id in store.sessions.get(lease.session, ()), f"lease {lease_id} missing from its session")
        if lease.kind is LeaseKind.WRITE:
            overlap = writing[lease.tier] & set(lease.slots)
            _require(not overlap, f"slots {sorted(overlap)} are in two write leases")
            writing[lease.tier].update(lease.slots)
        else:
            for ref in lease.refs:
                _require(ref in store.blocks and lease.tier in store.blocks[ref].copies, f"read lease {lease_id} holds a missing copy {ref}")
                pins[(lease.tier, ref)] += 1
    for session, ids in store.sessions.items():
        _require(bool(ids), f"session {session} is listed with no leases")
        for lease_id in ids:
            _require(lease_id in store.leases and store.leases[lease_id].session == session, f"session {session} lists lease {lease_id} it does not own")

    for tier, state in store.tiers.items():
        capacity = state.slots.capacity
        cached = {}
        pinned = 0
        loading = 0
        for ref, block in store.blocks.items():
            copy = block.copies.get(tier)
            if copy is None:
                continue
            _require(0 <= copy.slot < capacity, f"{tier.label} copy of {ref} has slot {copy.slot} outside 0..{capacity - 1}")
            _require(copy.slot not in cached, f"{tier.label} slot {copy.slot} holds both {cached.get(copy.slot)} and {ref}")
            cached[copy.slot] = ref
            _require(copy.pins == pins[(tier, ref)], f"{tier.label} copy of {ref} has {copy.pins} pins but {pins[(tier, ref)]} read leases")
            pinned += copy.pins > 0
            if copy.loading and tier == Tier.DEVICE:
                # Lent at once: the engine waits on the lease's transfer, not the daemon.
                source = block.copies.get(Tier.HOST)
                _require(source is not None and source.readers > 0, f"{ref} is loading into device without a protected host copy")
            elif copy.loading:
                from_cluster = copy.job is not None and copy.job.source is Tier.CLUSTER
                _require(tier == Tier.HOST and (Tier.DISK in block.copies or from_cluster),
                         f"{ref} is loading into {tier.label} without a disk copy or a cluster load")
                _require(copy.pins == 0, f"{tier.label} copy of {ref} is leased while its bytes are still loading")
                loading += 1
        free = set(state.slots.free_slots())
        _require(len(free) == state.slots.free_count, f"{tier.label} free list has duplicates")
        _require(state.writing == writing[tier], f"{tier.label} writing slots {sorted(state.writing)} differ from the write leases' and disk writes' {sorted(writing[tier])}")
        _require(not free & state.writing, f"{tier.label} slots {sorted(free & state.writing)} are both free and leased")
        _require(not free & cached.keys(), f"{tier.label} slots {sorted(free & cached.keys())} are both free and cached")
        _require(not state.writing & cached.keys(), f"{tier.label} slots {sorted(state.writing & cached.keys())} are both leased and cached")
        _require(
            len(free) + len(state.writing) + len(cached) == capacity,
            f"{tier.label}: free {len(free)} + writing {len(state.writing)} + cached {len(cached)} != capacity {capacity}",
        )
        _require(state.cached == len(cached), f"{tier.label} counts {state.cached} cached pages, index has {len(cached)}")
        _require(state.pinned == pinned, f"{tier.label} counts {state.pinned} pinned pages, index has {pinned}")
        loading_refs = {ref for ref, b in store.blocks.items() if tier in b.copies and b.copies[tier].loading}
        _require(state.loading == loading_refs, f"{tier.label} tracks {len(state.loading)} loading copies, index has {len(loading_refs)}")
        usage = store.stats().tier(tier)
        _require(usage.free + usage.writing + usage.cached == usage.capacity, f"{tier.label} stats do not add up to capacity: {usage}")
        _require(min(usage.pinned, usage.loading, usage.held, usage.idle) >= 0, f"{tier.label} stats break cached down wrongly: {usage}")
        if tier == Tier.HOST:
            _require(store.stats().loading == loading, f"store counts {store.stats().loading} loads, host has {loading} loading copies")
        _require(len(state.policy) == len(cached), f"{tier.label} policy tracks {len(state.policy)} pages, tier caches {len(cached)}")

    _check_namespaces(store)
    if Tier.DISK in store.tiers:
        _check_chunks(store)
    _check_hints(store)

    if disk_records is not None and Tier.DISK in store.tiers:
        persisted = {((r.namespace, r.key), r.slot) for r in disk_records}
        indexed = {(ref, b.copies[Tier.DISK].slot) for ref, b in store.blocks.items() if Tier.DISK in b.copies}
        # An entry dropped from the index is deleted from LMDB just after, outside the lock.
        leaving = {((r.namespace, r.key), r.slot) for r in store.forgetting}
        extra = persisted - indexed - leaving
        _require(not extra and indexed <= persisted, f"disk index and LMDB disagree: only in LMDB {sorted(extra)[:3]}, only in index {sorted(indexed - persisted)[:3]}")


def _check_hints(store: BlockStore) -> None:
    table = store.control.hints
    _require(all(ref in store.blocks for ref in table.hints), "a hint names a block that is not cached")
    _require(Counter(h.rank for h in table.hints.values()) == +table.counts, f"hint counts {table.counts} are not the table's")
    by_ns: dict[str, Counter] = {}
    for (namespace, _), hint in table.hints.items():
        by_ns.setdefault(namespace, Counter())[hint.rank] += 1
    _require(by_ns == {ns: +c for ns, c in table.by_namespace.items() if +c}, "hint counts by namespace are not the table's")
    sessions = {ref for refs in table.by_session.values() for ref in refs}
    _require(sessions == {ref for ref, h in table.hints.items() if h.session is not None}, "session hints are not the table's")
    quotas = store.control.capacity.quotas
    for namespace in table.by_namespace:
        limit = quotas.of(namespace).guaranteed_pages(Tier.HOST)
        pinned = table.hard_pins(namespace)
        _require(pinned <= limit, f"namespace {namespace!r} hard-pins {pinned} blocks, past its {limit} guaranteed host pages")


def _check_namespaces(store: BlockStore) -> None:
    held: Counter[tuple[str, Tier]] = Counter()
    for (namespace, _), block in store.blocks.items():
        for tier in block.copies:
            held[(namespace, tier)] += 1
    for lease in store.leases.values():
        if lease.kind is LeaseKind.WRITE:
            held[(lease.namespace, lease.tier)] += len(lease.slots)
    for namespace, _ in store.saving:
        held[(namespace, Tier.DISK)] += 1
    counted: Counter[tuple[str, Tier]] = Counter()
    for usage in store.stats().namespaces:
        for t in usage.tiers:
            counted[(usage.namespace, t.tier)] = t.pages
            _require(t.pages >= 0, f"namespace {usage.namespace!r} counts {t.pages} {t.tier.label} pages")
    wrong = {key: (counted[key], held[key]) for key in held.keys() | counted.keys() if counted[key] != held[key]}
    _require(not wrong, f"namespace page counts (counted, held) disagree with the index: {wrong}")
    for tier, state in store.tiers.items():
        total = sum(n for (_, t), n in counted.items() if t == tier)
        expected = state.cached + len(state.writing)
        _require(total == expected, f"namespaces hold {total} {tier.label} pages, the tier {expected}")


def check_quotas_kept(store: BlockStore) -> None:
    """No namespace holds more pages of a tier than its maximum."""
    for usage in store.stats().namespaces:
        for t in usage.tiers:
            _require(not t.max_pages or t.pages <= t.max_pages,
                     f"namespace {usage.namespace!r} holds {t.pages} {t.tier.label} pages, above its maximum {t.max_pages}")


def check_guarantees_kept(before: StoreUsage, after: StoreUsage, requester: str) -> None:
    """A request of `requester` took no other namespace below its guarantee (one already
    below it lost nothing)."""
    was = {(u.namespace, t.tier): t.pages for u in before.namespaces for t in u.tiers}
    for usage in after.namespaces:
        if usage.namespace == requester:
            continue
        for t in usage.tiers:
            floor = min(was.get((usage.namespace, t.tier), 0), t.guaranteed_pages)
            _require(t.pages >= floor, f"a request of {requester!r} took namespace {usage.namespace!r} to {t.pages} "
                                       f"{t.tier.label} pages, below {floor} (its guarantee {t.guaranteed_pages})")


def _check_chunks(store: BlockStore) -> None:
    disk = store.tiers[Tier.DISK]
    owners = Counter(c for b in store.blocks.values() if Tier.DISK in b.copies
                     for c in chunks_in(b.copies[Tier.DISK].record.extent))
    owners.update(c for record in store.saving.values() for c in chunks_in(record.extent))
    twice = [c for c, n in owners.items() if n > 1]
    _require(not twice, f"disk chunks {twice[:3]} belong to two pages")
    free = set(disk.chunks.free_chunks())
    _require(not free & owners.keys(), f"disk chunks {sorted(free & owners.keys())[:3]} are both free and used")
    _require(len(free) + len(owners) == disk.chunks.total,
             f"disk chunks: free {len(free)} + used {len(owners)} != {disk.chunks.total}: some leaked")
    stored = sum(b.copies[Tier.DISK].record.stored for b in store.blocks.values() if Tier.DISK in b.copies)
    _require(disk.stored_bytes == stored, f"disk counts {disk.stored_bytes} stored bytes, its copies {stored}")
