"""The miss history: blocks that left the index (their last copy went), so a lookup can
say why a key missed, and `explain` when and by whom.

Bounded in total, across namespaces: one FIFO of all the pool's namespaces, the oldest
entry forgotten first, so a client that makes namespaces (or misses in many) cannot grow
it. A key too old to remember reads as never stored. A block filed again under its key
(committed, recovered) is forgotten.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from kvtier_client.results import MissReason
from kvtier_client.tiers import Tier

from kvtier.policy import Ref

#: Entries per pool, all namespaces together (16 MiB at ENTRY_BYTES).
DEFAULT_HISTORY_SIZE = 65_536
#: What one entry costs, for stats and metrics: the OrderedDict's slot and node, the packed
#: value, and the ref it keeps alive (a 2-tuple and a 16-byte key). Measured: 210 B
#: allocated (tests/core/test_history.py), ~290 B of RSS with the allocators' rounding.
ENTRY_BYTES = 256


class Departure(NamedTuple):
    """How a block left the index: its last copy left `tier`."""

    reason: MissReason  # EVICTED, CORRUPT or DROPPED
    tier: Tier
    when: float  # time.monotonic()
    policy: str = ""  # EVICTED: the policy that chose it
    own_pressure: bool = False  # EVICTED: to make room for its own namespace


#: An entry is one int, a Departure packed (low bits first): reason (3 bits), tier (3),
#: own_pressure (1), policy (as an index into the history's few policy names, 8), and
#: `when` in microseconds. One int costs far less than a tuple and a float, and the garbage
#: collector does not track it, so a full history does not slow every collection.
_REASONS = tuple(MissReason)  # kvtier_client.results.MissReason, the one definition
assert len(_REASONS) <= 8, "a reason is 3 bits of an entry"
_CODE = {reason: code for code, reason in enumerate(_REASONS)}
_TIER_SHIFT, _PRESSURE_SHIFT, _POLICY_SHIFT, _WHEN_SHIFT = 3, 6, 7, 15
_MAX_POLICIES = 1 << (_WHEN_SHIFT - _POLICY_SHIFT)


class MissHistory:
    def __init__(self, size: int = DEFAULT_HISTORY_SIZE) -> None:
        if size < 0:
            raise ValueError(f"history size must be >= 0, got {size}")
        self.size = size
        self._gone: OrderedDict[Ref, int] = OrderedDict()
        self._policies: list[str] = [""]  # index -> name; a pool has one or two policies

    def __len__(self) -> int:
        return len(self._gone)

    @property
    def estimated_bytes(self) -> int:
        return len(self._gone) * ENTRY_BYTES

    def record(self, ref: Ref, reason: MissReason, tier: Tier, when: float, policy: str = "",
               own_pressure: bool = False) -> None:
        """`ref` is kept as the key: pass the departed block's own ref (no copy is made)."""
        if not self.size:
            return
        gone = self._gone
        gone[ref] = (_CODE[reason] | int(tier) << _TIER_SHIFT | own_pressure << _PRESSURE_SHIFT
                     | self._policy(policy) << _POLICY_SHIFT | int(when * 1e6) << _WHEN_SHIFT)
        if len(gone) > self.size:
            gone.popitem(last=False)

    def _policy(self, name: str) -> int:
        try:
            return self._policies.index(name)
        except ValueError:
            if len(self._policies) == _MAX_POLICIES:
                raise RuntimeError(f"more than {_MAX_POLICIES} eviction policy names in one pool's history") from None
            self._policies.append(name)
            return len(self._policies) - 1

    def forget(self, ref: Ref) -> None:
        self._gone.pop(ref, None)

    def reason(self, ref: Ref) -> MissReason | None:
        """Why `ref` left, or None if the history does not know it (all a lookup reads)."""
        entry = self._gone.get(ref)
        return None if entry is None else _REASONS[entry & 7]

    def departure(self, namespace: str, key: bytes) -> Departure | None:
        entry = self._gone.get((namespace, key))
        if entry is None:
            return None
        return Departure(_REASONS[entry & 7], Tier(entry >> _TIER_SHIFT & 7), (entry >> _WHEN_SHIFT) / 1e6,
                         self._policies[entry >> _POLICY_SHIFT & (_MAX_POLICIES - 1)],
                         bool(entry >> _PRESSURE_SHIFT & 1))
