"""Cache control: clients' pins, retains, demotes and drops on a prefix (kvtier_client.steering
says what each means to a client; docs/cache-control.md has the rules).

    pin / retain / unpin   set or clear hints in the table (kvtier.core.hints); the tiers'
                           policies rank victims by them (kvtier.policy.classes). A hard pin
                           is charged to the namespace's guaranteed host pages and refused,
                           changing nothing, past them; its blocks without a host copy
                           are loaded into host (kvtier.core.pin_loads: again until they
                           are, and after a restart), where the pin holds them.
    demote                 device copies go down to host, and with tier=disk host copies
                           are written to disk (outside the lock, in kvtier.core.writes.Writes.run)
                           and leave host.
    drop                   every copy on this node goes (the cluster tier, shared by
                           nodes, keeps its own); the history records them as
                           MissReason.DROPPED (a lookup's miss, `stats why`).

Blocks in use (leased, loading, being saved) are skipped and counted, never waited for:
a hint is not worth a stall. A request names keys; those not cached count as `missing`.
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from collections.abc import Callable

from kvtier_client.errors import CapacityError, FailedPrecondition
from kvtier_client.ids import SessionId
from kvtier_client.protocol import check_demote_tier, check_ttl, checked
from kvtier_client.results import MissReason
from kvtier_client.steering import PinMode, PinUsage, Priority, SteerResult
from kvtier_client.tiers import Tier

from kvtier.core.capacity import Capacity
from kvtier.core.disk_writes import DiskWrites
from kvtier.core.hints import Hint, HintTable
from kvtier.core.index import BlockIndex, check_keys, check_namespace
from kvtier.core.pin_loads import PinLoads
from kvtier.policy.classes import Rank

_RANK_OF_PRIORITY = {Priority.COLD: Rank.COLD, Priority.HIGH: Rank.HIGH}


class CacheControl:
    def __init__(self, index: BlockIndex, capacity: Capacity, disk_writes: DiskWrites, lock: threading.RLock,
                 run: Callable[[Callable], object], prefetch: Callable[..., int]) -> None:
        """`run`: the store's request loop (kvtier.core.writes.Writes.run); `prefetch`: the
        store's prefetch, to bring hard-pinned blocks into host."""
        self.index = index
        self.hints: HintTable = index.hints
        self.capacity = capacity
        self.disk_writes = disk_writes
        self._lock = lock
        self._run = run
        #: Hard-pinned blocks on their way into host (kvtier.core.pin_loads).
        self.pins = PinLoads(index, lock, prefetch)

    # -- hints ------------------------------------------------------------------------
    def pin(self, session: SessionId, namespace: str, keys: list[bytes], mode: PinMode, ttl: float) -> SteerResult:
        rank = Rank.HARD_PIN if PinMode(mode) is PinMode.HARD else Rank.SOFT_PIN
        result = self._set(session, namespace, keys, rank, ttl, f"{PinMode(mode).value} pin")
        if rank is Rank.HARD_PIN and result.applied:
            self.pins.pinned(namespace, keys)
        return result

    def retain(self, session: SessionId, namespace: str, keys: list[bytes], priority: Priority,
               ttl: float) -> SteerResult:
        priority = Priority(priority)
        if priority is Priority.NORMAL:
            return self.unpin(namespace, keys)
        return self._set(session, namespace, keys, _RANK_OF_PRIORITY[priority], ttl, f"retain {priority.label}")

    def unpin(self, namespace: str, keys: list[bytes]) -> SteerResult:
        """Clear every hint on `keys`: they rank as the policy alone says."""
        check_namespace(namespace)
        check_keys(keys)
        with self._lock:
            refs = self._cached(namespace, keys)
            cleared = sum(self.hints.clear(ref) for ref in refs)
            return SteerResult(cleared, len(set(keys)) - len(refs), len(refs) - cleared,
                               "" if cleared == len(refs) else "some had no hint")

    def _set(self, session: SessionId, namespace: str, keys: list[bytes], rank: Rank, ttl: float,
             what: str) -> SteerResult:
        check_namespace(namespace)
        check_keys(keys)
        checked(check_ttl, ttl)
        with self._lock:
            self.hints.expire()
            refs = self._cached(namespace, keys)
            if rank is Rank.HARD_PIN:
                self._check_hard(namespace, refs)
            now = self.hints.clock()
            reason = f"{what} by session {session}" + (f" for {ttl:g} s" if ttl else " while it lasts")
            hint = Hint(rank, now + ttl, None, reason) if ttl else Hint(rank, 0.0, session, reason)
            for ref in refs:
                self.hints.set(ref, hint)
            missing = len(set(keys)) - len(refs)
            return SteerResult(len(refs), missing, 0, f"{missing} keys not cached here" if missing else "")

    def _check_hard(self, namespace: str, refs: list) -> None:
        """Refuse, changing nothing, a hard pin that would take the namespace past its
        guaranteed host pages."""
        limit = self.capacity.quotas.of(namespace).guaranteed_pages(Tier.HOST)
        new = sum(1 for ref in refs if self.hints.rank(ref) is not Rank.HARD_PIN)
        pinned = self.hints.hard_pins(namespace)
        if pinned + new > limit:
            if not limit:
                raise FailedPrecondition(
                    f"namespace {namespace!r} has no guaranteed host pages, and a hard pin is charged to them: "
                    "give it guaranteed_host_pages in the tokens file, or use a soft pin (evicted last, never refused)"
                )
            raise CapacityError(
                f"hard-pinning {new} more blocks would take namespace {namespace!r} to {pinned + new} pinned pages, "
                f"past its {limit} guaranteed host pages: unpin some, use a soft pin, or raise its guarantee"
            )

    def fit_quotas(self) -> int:
        """Quotas changed (the store's lock held): a namespace's hard pins past its new
        guarantee become soft pins (evicted last, no longer never). Returns how many."""
        table, quotas, changed = self.hints, self.capacity.quotas, 0
        for namespace in [ns for ns in table.by_namespace if table.hard_pins(ns)]:
            limit = quotas.of(namespace).guaranteed_pages(Tier.HOST)
            excess = table.hard_pins(namespace) - limit
            for ref in [r for r, h in table.hints.items() if r[0] == namespace and h.rank is Rank.HARD_PIN][:max(0, excess)]:
                table.set(ref, replace(table.hints[ref], rank=Rank.SOFT_PIN))
                changed += 1
        return changed

    def _cached(self, namespace: str, keys: list[bytes]) -> list:
        """The refs of `keys` cached on this node, each once, in order."""
        blocks, seen, refs = self.index.blocks, set(), []
        for key in keys:
            ref = (namespace, key)
            if ref in blocks and ref not in seen:
                seen.add(ref)
                refs.append(ref)
        return refs

    # -- a warm restart keeps the hints with a TTL ------------------------------------
    def lasting(self) -> list[tuple[tuple[str, bytes], Hint]]:
        """The hints with a TTL still to run (those without end with their sessions,
        which a restart ends): what a restart should keep."""
        with self._lock:
            now = self.hints.clock()
            return [(ref, h) for ref, h in self.hints.hints.items() if h.expires > now]

    def restore(self, saved: list[tuple[tuple[str, bytes], Hint]]) -> int:
        """Set hints a previous daemon kept, on the blocks cached now (after its quotas are
        set: hard pins past a guarantee become soft, as `fit_quotas` does). Returns how many."""
        with self._lock:
            now, restored = self.hints.clock(), 0
            for ref, hint in saved:
                if hint.expires > now and ref in self.index.blocks and hint.rank is not Rank.NORMAL:
                    self.hints.set(ref, replace(hint, session=None))
                    restored += 1
            self.fit_quotas()
            self.pins.want(self.hints.hard)  # those not in host load at the keeper's next sweep
            return restored

    def describe(self, ref) -> str:
        """The ref's hint in words for `stats why` ("" if none), e.g. "hard pin by session
        s1 for 60 s (42 s left)" (the store's lock held)."""
        hint = self.hints.get(ref)
        if hint is None:
            return ""
        return hint.reason + (f" ({hint.expires - self.hints.clock():.0f} s left)" if hint.expires else "")

    def end_session(self, session: SessionId) -> int:
        """The session ended: its hints without a TTL end with it (the store's lock held)."""
        return self.hints.end_session(session)

    def expire(self) -> int:
        with self._lock:
            return len(self.hints.expire())

    def usage(self, namespace: str) -> PinUsage:
        with self._lock:
            self.hints.expire()
            counts = self.hints.by_namespace.get(namespace, {})
            ends = [h.expires for ref, h in self.hints.hints.items() if ref[0] == namespace and h.expires]
            quota = self.capacity.quotas.of(namespace)
            held = self.pins.count(namespace)
            return PinUsage(counts.get(Rank.HARD_PIN, 0), counts.get(Rank.SOFT_PIN, 0), counts.get(Rank.HIGH, 0),
                            counts.get(Rank.COLD, 0), max(0.0, min(ends) - self.hints.clock()) if ends else 0.0,
                            quota.guaranteed_pages(Tier.HOST),
                            hard_in_host=held.in_host, hard_loading=held.loading, hard_waiting=held.waiting)

    # -- moves ------------------------------------------------------------------------
    def demote(self, namespace: str, keys: list[bytes], tier: Tier = Tier.DISK) -> SteerResult:
        """Move the cached blocks of `keys` below `tier`'s upper neighbours: to host (off
        the device), or to disk (off device and host)."""
        check_namespace(namespace)
        check_keys(keys)
        checked(check_demote_tier, tier)
        tier = Tier(tier)
        if tier not in self.index.tiers:
            raise FailedPrecondition(f"this pool has no {tier.label} tier to demote to; demote to host, or drop")
        return self._run(lambda: self._demote(namespace, keys, tier))

    def _demote(self, namespace: str, keys: list[bytes], tier: Tier) -> SteerResult:
        index, capacity = self.index, self.capacity
        refs = self._cached(namespace, keys)
        blocks = [index.blocks[ref] for ref in refs]
        now = time.monotonic()
        above = [t for t in (Tier.DEVICE, Tier.HOST) if t < tier and t in index.tiers]
        busy = [b for b in blocks if any(b.copies[t].is_protected(now) for t in above if t in b.copies)]
        pinned = [b for b in blocks if tier is Tier.DISK and Tier.HOST in b.copies
                  and self.hints.rank(b.ref) is Rank.HARD_PIN and b not in busy]
        movable = [b for b in blocks if b not in busy and b not in pinned]
        on_device = [b for b in movable if Tier.DEVICE in b.copies]
        if on_device:
            capacity.evict(Tier.DEVICE, on_device, namespace)  # copies down to host first
        moved = [b for b in movable if not any(t in b.copies for t in above)]
        if tier is Tier.DISK:
            on_host = [b for b in movable if Tier.HOST in b.copies]
            self.disk_writes.write_out_first(on_host, admitted_only=False)  # the client asked for disk
            going = [b for b in on_host if Tier.DISK in b.copies]
            if going:
                capacity.evict(Tier.HOST, going, namespace)
            moved += going
        notes = [f"{len(busy)} in use (leased or loading)" if busy else "",
                 f"{len(pinned)} hard-pinned (unpin first)" if pinned else "",
                 f"{len(movable) - len(moved)} not written to disk (full or failed)" if len(moved) < len(movable) else ""]
        return SteerResult(len(moved), len(set(keys)) - len(refs), len(refs) - len(moved),
                           "; ".join(n for n in notes if n))

    def drop(self, namespace: str, keys: list[bytes]) -> SteerResult:
        """Forget the cached blocks of `keys` on this node, every tier (a block in use is skipped)."""
        check_namespace(namespace)
        check_keys(keys)
        return self._run(lambda: self._drop(namespace, keys))

    def _drop(self, namespace: str, keys: list[bytes]) -> SteerResult:
        index = self.index
        refs = self._cached(namespace, keys)
        now = time.monotonic()
        dropped = 0
        for ref in refs:
            block = index.blocks[ref]
            if any(copy.is_protected(now, holds=False) for copy in block.copies.values()):
                continue
            last = min(block.copies)
            for tier in sorted(block.copies, reverse=True):
                self.capacity.drop([block], tier)
            index.history.record(ref, MissReason.DROPPED, last, now)
            dropped += 1
        busy = len(refs) - dropped
        return SteerResult(dropped, len(set(keys)) - len(refs), busy, f"{busy} in use (leased or loading)" if busy else "")
