"""Policy: which cached pages of a tier to evict, and which host pages are worth a disk
write (admission). Pure decisions over block references, no I/O, so a policy can be
replayed against a trace with no tier behind it.

`PolicyName` is the one spelling of the policies' names: configuration, the command line
and the docs take their choices from it, and `make_policy` turns a name into an object
for whoever assembles a store (the core is handed policy objects, it never reads names).
"""
from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from kvtier.policy.admission import Admission, AdmissionName, AdmitAll, ReuseAdmission, Watched, make_admission
from kvtier.policy.arc import ARCPolicy
from kvtier.policy.base import EvictionPolicy, Ref
from kvtier.policy.frecency import FrecencyPolicy
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.prefix import PrefixLRUPolicy
from kvtier.policy.s3fifo import S3FIFOPolicy
from kvtier.policy.tinylfu import TinyLFUPolicy


class PolicyName(str, Enum):
    LRU = "lru"
    PREFIX = "prefix"
    FRECENCY = "frecency"
    # Published designs measured against frecency (docs/policies.md); not prefix-aware.
    ARC = "arc"
    S3FIFO = "s3fifo"
    TINYLFU = "tinylfu"

    def __str__(self) -> str:
        return self.value


#: Each makes a policy object for one tier from the tier's page count.
POLICIES: dict[PolicyName, Callable[[int], EvictionPolicy]] = {
    PolicyName.LRU: LRUPolicy,
    PolicyName.PREFIX: PrefixLRUPolicy,
    PolicyName.FRECENCY: FrecencyPolicy,
    PolicyName.ARC: ARCPolicy,
    PolicyName.S3FIFO: S3FIFOPolicy,
    PolicyName.TINYLFU: TinyLFUPolicy,
}


def make_policy(name: PolicyName | str, capacity: int) -> EvictionPolicy:
    """A new policy object for one tier of `capacity` pages."""
    try:
        return POLICIES[PolicyName(name)](capacity)
    except ValueError:
        raise ValueError(f"unknown eviction policy {name!r}; use one of {', '.join(POLICIES)}") from None


__all__ = ["POLICIES", "ARCPolicy", "Admission", "AdmissionName", "AdmitAll", "EvictionPolicy", "FrecencyPolicy", "LRUPolicy",
           "PolicyName", "PrefixLRUPolicy", "Ref", "ReuseAdmission", "S3FIFOPolicy", "TinyLFUPolicy", "Watched", "make_admission", "make_policy"]
