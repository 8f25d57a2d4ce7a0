"""Policy: which cached pages of a tier to evict, and which host pages are worth a disk
write (admission). Pure decisions over block references, no I/O, so a policy can be
replayed against a trace with no tier behind it.

`POLICIES` is the one list of the eviction policies, by name (kvtier.registry): the
configuration, the command lines and the docs take their names from it, and `make_policy`
turns a name into an object for whoever assembles a store (the core is handed policy
factories, it never reads names). A policy from outside kvtier is named by its module path
(`--policy mypkg.policies:MyPolicy`) or registered under the entry point group
`kvtier.policies`; docs/policies.md, "Adding a policy", says what one must provide.
"""
from __future__ import annotations

from collections.abc import Callable

from kvtier.policy.admission import Admission, AdmissionName, AdmitAll, ReuseAdmission, Watched, make_admission
from kvtier.policy.arc import ARCPolicy
from kvtier.policy.base import EvictionPolicy, Ref
from kvtier.policy.frecency import FrecencyPolicy
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.prefix import PrefixLRUPolicy
from kvtier.policy.s3fifo import S3FIFOPolicy
from kvtier.policy.tinylfu import TinyLFUPolicy
from kvtier.registry import Registry, RegistryError

#: Makes a policy object for one tier from the tier's page count.
PolicyFactory = Callable[[int], EvictionPolicy]


def _admit(name: str, factory: PolicyFactory) -> None:
    """Check a policy from outside kvtier: it must make, from a page count, an object with
    every method of EvictionPolicy (tried once, on a one-page tier)."""
    if not callable(factory):
        raise RegistryError(f"eviction policy {name!r} is {factory!r}, not a class or a function of the tier's "
                            "page count")
    try:
        probe = factory(1)
    except Exception as exc:
        raise RegistryError(f"eviction policy {name!r} could not be made for a 1-page tier: "
                            f"{type(exc).__name__}: {exc}") from None
    missing = [m for m in ("name", "add", "touch", "remove", "victims", "__len__") if not hasattr(probe, m)]
    if missing:
        raise RegistryError(f"eviction policy {name!r} makes a {type(probe).__name__} without {', '.join(missing)} "
                            "(kvtier.policy.base.EvictionPolicy says what one provides)")


#: Every eviction policy, by name: the built-ins, then those from outside kvtier.
#: (arc, s3fifo and tinylfu are published designs measured against frecency in
#: docs/policies.md; they are not prefix-aware.)
POLICIES: Registry[PolicyFactory] = Registry(
    "eviction policy", "kvtier.policies", 'docs/policies.md, "Adding a policy"',
    {p.name: p for p in (LRUPolicy, PrefixLRUPolicy, FrecencyPolicy, ARCPolicy, S3FIFOPolicy, TinyLFUPolicy)},
    admit=_admit)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """A new policy object for one tier of `capacity` pages; RegistryError (a ValueError)
    for a name that is not a policy's."""
    return POLICIES[name](capacity)


__all__ = ["POLICIES", "ARCPolicy", "Admission", "AdmissionName", "AdmitAll", "EvictionPolicy", "FrecencyPolicy", "LRUPolicy",
           "PolicyFactory", "PrefixLRUPolicy", "Ref", "ReuseAdmission", "S3FIFOPolicy", "TinyLFUPolicy", "Watched",
           "make_admission", "make_policy"]
