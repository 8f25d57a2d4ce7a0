"""The eviction policy interface. One policy object per tier.

The core tells the policy what became cached (`add`), what was used (`touch`) and what
left the tier (`remove`); it asks `victims(n, protected)` when it needs n slots. `victims`
only proposes: it returns up to n references in eviction order and changes nothing, so a
caller that gets fewer than it needs can refuse the whole request with no state changed
(vLLM's atomic `evict(n)`). The core calls `remove` for each victim it really evicts.

A policy is made from its tier's page count (`cls(capacity)`); one from outside kvtier
is a class (or function) so made, registered by module path or entry point
(kvtier.policy.POLICIES, docs/policies.md "Adding a policy"). Every call comes under the
store's lock: keep them O(1) or close to it, and never block.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

#: A block reference: (namespace, key). The namespace is part of the identity, so equal
#: client keys in two namespaces are two blocks.
Ref = tuple[str, bytes]


class EvictionPolicy(Protocol):
    #: Shown where an eviction is explained (`kvtier stats why`).
    name: str

    def add(self, ref: Ref, parent: Ref | None) -> None:
        """`ref` became cached in this tier; `parent` is the block before it in its prefix."""

    def touch(self, ref: Ref) -> None:
        """`ref` was used (acquired, or committed again)."""

    def remove(self, ref: Ref) -> None:
        """`ref` left this tier."""

    def victims(self, n: int, protected: Callable[[Ref], bool]) -> list[Ref]:
        """Up to n evictable references in eviction order; fewer means no more can go."""

    def __len__(self) -> int: ...
