"""Policy: which cached pages of a tier to evict. Pure decisions over block references,
no I/O, so a policy can be replayed against a trace with no tier behind it.

`PolicyName` is the one spelling of the policies' names: configuration, the command line
and the docs take their choices from it, and `make_policy` turns a name into an object
for whoever assembles a store (the core is handed policy objects, it never reads names).
"""
from __future__ import annotations

from enum import Enum

from collections.abc import Callable

from kvtier.policy.base import EvictionPolicy, Ref
from kvtier.policy.frecency import FrecencyPolicy
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.prefix import PrefixLRUPolicy


class PolicyName(str, Enum):
    LRU = "lru"
    PREFIX = "prefix"
    FRECENCY = "frecency"

    def __str__(self) -> str:
        return self.value


#: Each makes a policy object for one tier from the tier's page count.
POLICIES: dict[PolicyName, Callable[[int], EvictionPolicy]] = {
    PolicyName.LRU: LRUPolicy,
    PolicyName.PREFIX: PrefixLRUPolicy,
    PolicyName.FRECENCY: FrecencyPolicy,
}


def make_policy(name: PolicyName | str, capacity: int) -> EvictionPolicy:
    """A new policy object for one tier of `capacity` pages."""
    try:
        return POLICIES[PolicyName(name)](capacity)
    except ValueError:
        raise ValueError(f"unknown eviction policy {name!r}; use one of {', '.join(POLICIES)}") from None


__all__ = ["POLICIES", "EvictionPolicy", "FrecencyPolicy", "LRUPolicy", "PolicyName", "PrefixLRUPolicy", "Ref", "make_policy"]
