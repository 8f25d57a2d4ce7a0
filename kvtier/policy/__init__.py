"""Policy: which cached pages of a tier to evict. Pure decisions over block references,
no I/O, so a policy can be replayed against a trace with no tier behind it."""
from kvtier.policy.base import EvictionPolicy, Ref
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.prefix import PrefixLRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "prefix": PrefixLRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; use one of {', '.join(POLICIES)}") from None


__all__ = ["POLICIES", "EvictionPolicy", "LRUPolicy", "PrefixLRUPolicy", "Ref", "make_policy"]
