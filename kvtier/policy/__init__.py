"""Policy: which cached pages of a tier to evict. Pure decisions over block references,
no I/O, so a policy can be replayed against a trace with no tier behind it.

`PolicyName` is the one spelling of the policies' names: configuration, the command line
and the docs take their choices from it, and `make_policy` turns a name into an object
for whoever assembles a store (the core is handed policy objects, it never reads names).
"""
from __future__ import annotations

from enum import Enum

from kvtier.policy.base import EvictionPolicy, Ref
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.prefix import PrefixLRUPolicy


class PolicyName(str, Enum):
    LRU = "lru"
    PREFIX = "prefix"

    def __str__(self) -> str:
        return self.value


POLICIES: dict[PolicyName, type[EvictionPolicy]] = {PolicyName.LRU: LRUPolicy, PolicyName.PREFIX: PrefixLRUPolicy}


def make_policy(name: PolicyName | str) -> EvictionPolicy:
    """A new policy object for one tier."""
    try:
        return POLICIES[PolicyName(name)]()
    except ValueError:
        raise ValueError(f"unknown eviction policy {name!r}; use one of {', '.join(POLICIES)}") from None


__all__ = ["POLICIES", "EvictionPolicy", "LRUPolicy", "PolicyName", "PrefixLRUPolicy", "Ref", "make_policy"]
