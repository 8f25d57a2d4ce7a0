"""Tenant quotas: how many pages of a tier a namespace may hold, and how many other
namespaces may never take from it.

    max         at it, a namespace makes room by evicting its own pages first; if it
                cannot, its request fails (its borrow or acquire) or stops short (its
                prefetch, its copies to disk)
    guaranteed  another namespace's request never evicts it below this

Only host and disk have quotas; device pages are counted, not limited. `QuotaBook` holds
the quotas in force and their arithmetic over the index's counts; kvtier.core.capacity
applies them when it makes room, and `VictimPicker` is the one place that keeps a
guarantee while the policy chooses.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvtier_client.tiers import Tier

from kvtier.core.index import Block, BlockIndex
from kvtier.policy import EvictionPolicy, Ref


@dataclass(frozen=True)
class Quota:
    max_host_pages: int = 0  # 0 = no limit
    max_disk_pages: int = 0
    guaranteed_host_pages: int = 0  # other namespaces never evict this one below it
    guaranteed_disk_pages: int = 0

    def max_pages(self, tier: Tier) -> int:
        return self.max_host_pages if tier == Tier.HOST else self.max_disk_pages if tier == Tier.DISK else 0

    def guaranteed_pages(self, tier: Tier) -> int:
        if tier == Tier.HOST:
            return self.guaranteed_host_pages
        return self.guaranteed_disk_pages if tier == Tier.DISK else 0


#: Tiers that take quotas.
QUOTA_TIERS = (Tier.HOST, Tier.DISK)
NO_QUOTA = Quota()


def check_quotas(quotas: Mapping[str, Quota], capacities: Mapping[Tier, int]) -> None:
    """Raise ValueError, naming the first problem, if these quotas cannot all be kept in
    tiers of these capacities (tiers missing from `capacities` are not checked: a store
    without that tier has nothing to guarantee there)."""
    for namespace, quota in quotas.items():
        for tier in QUOTA_TIERS:
            limit, floor = quota.max_pages(tier), quota.guaranteed_pages(tier)
            if limit < 0 or floor < 0:
                raise ValueError(f"namespace {namespace!r}: {tier.label} quota pages must be >= 0")
            if limit and floor > limit:
                raise ValueError(
                    f"namespace {namespace!r}: guaranteed {tier.label} pages ({floor}) exceed its maximum ({limit})"
                )
    for tier, capacity in capacities.items():
        if tier not in QUOTA_TIERS:
            continue
        total = sum(q.guaranteed_pages(tier) for q in quotas.values())
        if total > capacity:
            raise ValueError(
                f"guaranteed {tier.label} pages add up to {total}, more than the tier's {capacity} pages"
            )


class QuotaBook:
    """The quotas in force (`set` replaces them; a namespace missing has none) and what they
    say about the index's counts now. Without quotas the namespace decides nothing."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self.quotas: dict[str, Quota] = {}

    def __bool__(self) -> bool:
        return bool(self.quotas)

    def set(self, quotas: Mapping[str, Quota]) -> None:
        self.quotas = {ns: quota for ns, quota in quotas.items() if quota != NO_QUOTA}

    def of(self, namespace: str) -> Quota:
        return self.quotas.get(namespace, NO_QUOTA)

    def usage(self, namespace: str, tier: Tier) -> int:
        counters = self.index.namespaces.get(namespace)
        return counters.pages[tier] if counters else 0

    def spare(self, tier: Tier, namespace: str) -> dict[str, int]:
        """How far above its guarantee in `tier` every other namespace with one is."""
        return {
            ns: self.usage(ns, tier) - quota.guaranteed_pages(tier)
            for ns, quota in self.quotas.items()
            if ns != namespace and quota.guaranteed_pages(tier)
        }

    def over(self, tier: Tier, namespace: str, n: int) -> int:
        """How many of its own pages `namespace` must give up in `tier` before n more fit its
        quota (<= 0: none)."""
        limit = self.of(namespace).max_pages(tier)
        return self.usage(namespace, tier) + n - limit if limit else 0

    def full_message(self, tier: Tier, n: int, namespace: str) -> str:
        return (
            f"namespace {namespace!r} is at its {tier.label} quota of {self.of(namespace).max_pages(tier)} pages: "
            f"{self.usage(namespace, tier)} in use, {n} more needed, too few of its own evictable; "
            "release its leases or raise its quota"
        )

    def by_namespace(self, blocks: list[Block]) -> list[tuple[str, list[Block]]]:
        """`blocks` in one batch per namespace, as quotas are kept per namespace; without
        quotas in one batch (the namespace decides nothing then)."""
        if not self.quotas:
            return [(blocks[0].ref[0], blocks)] if blocks else []
        groups: dict[str, list[Block]] = {}
        for b in blocks:
            groups.setdefault(b.ref[0], []).append(b)
        return list(groups.items())


class VictimPicker:
    """Victims in one tier for one request of `namespace`, in the policy's order, never
    taking another namespace below its guarantee.

    The policy only proposes. A proposal that would take a guaranteed namespace too far is
    walked, the excess skipped and that namespace shielded, and the policy asked again for
    the rest; every such round shields one more namespace, so it ends. The predicates
    handed to the policy never change during its call (the prefix policy may ask twice
    about one ref).
    """

    def __init__(self, policy: EvictionPolicy, namespace: str, spare: dict[str, int]) -> None:
        """`spare`: for each other namespace with a guarantee in this tier, how many pages
        it holds above it."""
        self.policy = policy
        self.namespace = namespace
        self.spare = spare
        self.chosen: list[Ref] = []
        self._chosen: set[Ref] = set()
        self._shielded = {ns for ns, n in spare.items() if n <= 0}

    def take(self, n: int, protected: Callable[[Ref], bool], last_resort: Callable[[Ref], bool] | None = None,
             *, own: bool = False) -> None:
        """Choose up to n more victims (with `own`, only the requester's own pages); pages
        only `last_resort` leaves unprotected only if that is not enough."""
        want = len(self.chosen) + n
        for predicate in (protected, last_resort):
            if predicate is None:
                return
            while len(self.chosen) < want:
                proposal = self.policy.victims(want - len(self.chosen), self._skip(predicate, own))
                kept = [ref for ref in proposal if self._allowed(ref)] if self.spare else proposal
                self.chosen += kept
                self._chosen.update(kept)
                if len(kept) == len(proposal):
                    break  # all asked for, or all this predicate allows

    def _skip(self, protected: Callable[[Ref], bool], own: bool) -> Callable[[Ref], bool]:
        chosen, shielded = self._chosen, self._shielded
        if own:
            namespace = self.namespace
            return lambda ref: ref[0] != namespace or ref in chosen or protected(ref)
        if not chosen and not shielded:
            return protected
        return lambda ref: ref in chosen or ref[0] in shielded or protected(ref)

    def _allowed(self, ref: Ref) -> bool:
        namespace = ref[0]
        if namespace not in self.spare:
            return True
        if self.spare[namespace] > 0:
            self.spare[namespace] -= 1
            return True
        self._shielded.add(namespace)
        return False
