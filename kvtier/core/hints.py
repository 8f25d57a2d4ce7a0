"""Clients' hints on blocks: the table, nothing else. Which class each hinted block is in
(kvtier.policy.classes.Rank), until when, and for whom. The rules that set them are
kvtier.core.control's; the eviction policies read them through `TierRanks`.

A hint lasts until its `expires` (wall-clock seconds, so it survives a warm restart), or,
with none, until the session that set it ends. An expired hint ranks NORMAL at once (the
policies read `rank`, which checks the time) and leaves the table at the next `expire`.
"""
from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from kvtier_client.ids import SessionId
from kvtier_client.tiers import Tier

from kvtier.policy import Ref
from kvtier.policy.classes import Rank

_NORMAL, _SOFT, _HARD = Rank.NORMAL, Rank.SOFT_PIN, Rank.HARD_PIN


@dataclass(frozen=True)
class Hint:
    rank: Rank  # never NORMAL: no hint is normal
    expires: float = 0.0  # time.time() it ends; 0: when `session` ends
    session: SessionId | None = None  # the session it ends with (only without `expires`)
    reason: str = ""  # who set it, for `stats why` (e.g. "pin by session 7", "vllm kv_hints")


class HintTable:
    """Hints by block, with counts by class and by namespace kept as they change."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        """`clock`: wall-clock seconds (a replay gives its trace's time)."""
        self.clock = clock
        self.hints: dict[Ref, Hint] = {}
        self.counts: Counter[Rank] = Counter()
        self.by_namespace: defaultdict[str, Counter[Rank]] = defaultdict(Counter)
        self.by_session: defaultdict[SessionId, set[Ref]] = defaultdict(set)
        #: Hard-pinned refs (an expired one too, until `expire`): kvtier.core.pin_loads reads them.
        self.hard: set[Ref] = set()
        #: No TTL ends before this (it may be early, after a clear): `expire` scans only then.
        self._next_expiry = math.inf

    def __len__(self) -> int:
        return len(self.hints)

    def get(self, ref: Ref, now: float | None = None) -> Hint | None:
        """The ref's hint, None if it has none or it has expired."""
        hint = self.hints.get(ref)
        if hint is None or (hint.expires and hint.expires <= (self.clock() if now is None else now)):
            return None
        return hint

    def rank(self, ref: Ref) -> Rank:
        hint = self.hints.get(ref)
        if hint is None or (hint.expires and hint.expires <= self.clock()):
            return _NORMAL
        return hint.rank

    def ranker(self) -> Callable[[Ref], Rank]:
        """`rank` with the time read once: for a policy's walk over many refs."""
        hints, now = self.hints, self.clock()

        def rank(ref: Ref) -> Rank:
            hint = hints.get(ref)
            return _NORMAL if hint is None or (hint.expires and hint.expires <= now) else hint.rank

        return rank

    def set(self, ref: Ref, hint: Hint) -> None:
        self.clear(ref)
        self.hints[ref] = hint
        if hint.expires:
            self._next_expiry = min(self._next_expiry, hint.expires)
        self.counts[hint.rank] += 1
        self.by_namespace[ref[0]][hint.rank] += 1
        if hint.rank is _HARD:
            self.hard.add(ref)
        if hint.session is not None:
            self.by_session[hint.session].add(ref)

    def clear(self, ref: Ref) -> bool:
        """Remove the ref's hint; False if it had none."""
        hint = self.hints.pop(ref, None)
        if hint is None:
            return False
        self.counts[hint.rank] -= 1
        self.by_namespace[ref[0]][hint.rank] -= 1
        self.hard.discard(ref)
        if hint.session is not None:
            refs = self.by_session[hint.session]
            refs.discard(ref)
            if not refs:
                del self.by_session[hint.session]
        return True

    def hard_pins(self, namespace: str) -> int:
        return self.by_namespace[namespace][_HARD] if namespace in self.by_namespace else 0

    def expire(self, now: float | None = None) -> list[Ref]:
        """Drop the hints whose TTL has passed; returns their refs."""
        now = self.clock() if now is None else now
        if now < self._next_expiry:
            return []  # every pin and retain calls this: most calls scan nothing
        gone = [ref for ref, hint in self.hints.items() if hint.expires and hint.expires <= now]
        for ref in gone:
            self.clear(ref)
        self._next_expiry = min((h.expires for h in self.hints.values() if h.expires), default=math.inf)
        return gone

    def end_session(self, session: SessionId) -> int:
        """Drop the hints that lasted as long as `session`; returns how many."""
        refs = list(self.by_session.get(session, ()))
        for ref in refs:
            self.clear(ref)
        return len(refs)


class TierRanks:
    """The table as one tier's policy sees it (kvtier.policy.classes.Ranks): a hard pin
    holds in host only, and ranks as a soft pin in the other tiers."""

    def __init__(self, table: HintTable, tier: Tier) -> None:
        self.table = table
        self.hard = tier is Tier.HOST

    def rank(self, ref: Ref) -> Rank:
        rank = self.table.rank(ref)
        return _SOFT if rank is _HARD and not self.hard else rank

    def ranker(self) -> Callable[[Ref], Rank]:
        rank = self.table.ranker()
        if self.hard:
            return rank
        return lambda ref: _SOFT if (r := rank(ref)) is _HARD else r

    def count(self, rank: Rank) -> int:
        counts = self.table.counts
        if self.hard or rank not in (_SOFT, _HARD):
            return counts[rank]
        return counts[_SOFT] + counts[_HARD] if rank is _SOFT else 0
