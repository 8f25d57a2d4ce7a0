"""Cache control: what a client (an agent framework, an engine) may tell the daemon about a
prefix, and what the daemon answers. The one vocabulary both transports, the CLI and the
daemon's core use; docs/cache-control.md has the rules.

    pin      hard: never evicted from host while pinned (charged to the namespace's
             guaranteed host pages); soft: evicted last, in every tier
    retain   a priority class: cold (evicted first), normal (no hint), high (after normal)
    unpin    back to normal
    demote   move the prefix's pages below `tier` now (host -> disk)
    drop     forget the prefix in this node's tiers now
    prefetch (KVTierClient.prefetch, its own call) with a deadline: the pages are held
             in host until then

A pin or retain lasts `ttl` seconds; with ttl 0 it lasts until unpinned or until the
session that set it ends. A hint with a TTL outlives its session and a warm restart.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

#: The longest TTL a hint may ask for: a week. Longer is a configuration, not a hint.
MAX_TTL_SECONDS = 7 * 24 * 3600.0
#: The longest a prefetch may ask its pages to be held (its deadline): ten minutes. A
#: longer wait is a pin's.
MAX_PREFETCH_HOLD = 600.0


class Action(enum.IntEnum):
    PIN = 1
    UNPIN = 2
    RETAIN = 3
    DEMOTE = 4
    DROP = 5

    @property
    def label(self) -> str:
        return self.name.lower()


class PinMode(str, enum.Enum):
    HARD = "hard"
    SOFT = "soft"


class Priority(enum.IntEnum):
    COLD = 0
    NORMAL = 1
    HIGH = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Priority:
        try:
            return cls[text.upper()]
        except KeyError:
            raise ValueError(f"unknown priority {text!r}; use cold, normal or high") from None


@dataclass(frozen=True)
class SteerResult:
    """What a hint did to the keys it named (in order, each counted once)."""

    applied: int  # blocks the hint now holds (pinned, retained, demoted, dropped, unpinned)
    missing: int  # keys not cached on this node: nothing to do for them
    skipped: int = 0  # cached, but left as they were (`note` says why: leased, pinned, no lower tier)
    note: str = ""


@dataclass(frozen=True)
class PinUsage:
    """One namespace's hints in one pool: blocks per class, and when the first TTL ends."""

    hard: int = 0
    soft: int = 0
    high: int = 0
    cold: int = 0
    next_expiry_seconds: float = 0.0  # from now; 0: none of them has a TTL
    hard_limit: int = 0  # its guaranteed host pages: the most it may hard-pin
    # Its hard-pinned blocks by where their host copy is: loaded (the pin holds it), loading,
    # or waiting for room to load (after a restart, or a pin while host was full).
    hard_in_host: int = 0
    hard_loading: int = 0
    hard_waiting: int = 0
