"""The miss history: blocks that left the index (their last copy went), so a lookup can
say why a key missed, and `explain` when and by whom.

Bounded per namespace, the oldest forgotten first: a key too old to remember reads as
never stored. A block filed again under its key (committed, recovered) is forgotten.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from enum import Enum
from typing import NamedTuple

from kvtier_client.tiers import Tier

from kvtier.policy import Ref

DEFAULT_HISTORY_SIZE = 65_536


class MissReason(str, Enum):
    """Why a looked-up key was not part of the hit prefix."""

    NEVER_STORED = "never_stored"  # no record of it (or too old to remember)
    EVICTED = "evicted"  # its last copy was evicted
    CORRUPT = "corrupt"  # its last copy failed its checksum and was dropped
    BEYOND_PREFIX = "beyond_prefix"  # cached, but after a key that is not


class Departure(NamedTuple):
    """How a block left the index: its last copy left `tier`."""

    reason: MissReason  # EVICTED or CORRUPT
    tier: Tier
    when: float  # time.monotonic()
    policy: str = ""  # EVICTED: the policy that chose it
    own_pressure: bool = False  # EVICTED: to make room for its own namespace


#: What the history keeps per key: a Departure's fields as a tuple of plain values (the
#: enums by value). It costs an eviction far less to make than a Departure, and holding only
#: atomic values the garbage collector stops tracking it, so a full history does not slow
#: every collection. The reason comes first: all a lookup reads.
Entry = tuple[str, int, float, str, bool]
_VALUE = {reason: reason.value for reason in MissReason}  # faster than reading .value
_NOTHING: Mapping[bytes, Entry] = {}


class MissHistory:
    def __init__(self, size: int = DEFAULT_HISTORY_SIZE) -> None:
        if size < 0:
            raise ValueError(f"history size must be >= 0, got {size}")
        self.size = size
        self._gone: dict[str, OrderedDict[bytes, Entry]] = {}

    def record(self, ref: Ref, reason: MissReason, tier: Tier, when: float, policy: str = "",
               own_pressure: bool = False) -> None:
        namespace, key = ref
        gone = self._gone.get(namespace)
        if gone is None:
            gone = self._gone[namespace] = OrderedDict()
        gone[key] = (_VALUE[reason], int(tier), when, policy, own_pressure)
        if len(gone) > self.size:
            gone.popitem(last=False)

    def forget(self, ref: Ref) -> None:
        gone = self._gone.get(ref[0])
        if gone:
            gone.pop(ref[1], None)

    def of(self, namespace: str) -> Mapping[bytes, Entry]:
        """The namespace's departed blocks by key (read only)."""
        return self._gone.get(namespace, _NOTHING)

    def departure(self, namespace: str, key: bytes) -> Departure | None:
        entry = self.of(namespace).get(key)
        if entry is None:
            return None
        reason, tier, when, policy, own_pressure = entry
        return Departure(MissReason(reason), Tier(tier), when, policy, own_pressure)
