"""What an engine's hints would buy: a Mooncake trace replayed through the real store
(kvtier.replay.mooncake) with an online hint rule that calls the store's cache control
(kvtier.core.control) after each request, as a client would, on the trace's own clock.

The rule `continue-ttl` reads only the requests already served:

- Request r *continues* request q when r's leading blocks that earlier requests held
  number k >= 2, q is the latest earlier request holding r's block k-1, and k >= len(q) - 1:
  r starts with all of q's blocks but at most its last (a turn's last block is partial, so
  the next turn's input rewrites it). A shared system prompt alone (k = 1) is no conversation.
- After serving a continuation r, the gap t_r - t_q joins the gaps seen so far, and r's
  blocks are retained HIGH with a TTL of `factor` x the median of those gaps (none set if
  that is under a second). Nothing else is hinted: first turns and one-off requests stay
  normal, and a hint whose TTL has passed ranks normal again.

The store's hint clock reads the trace's time: the arrival of the request being served.
"""
from __future__ import annotations

import bisect
import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier_client.ids import SessionId
from kvtier_client.steering import MAX_TTL_SECONDS, Priority

from kvtier.core import BlockStore
from kvtier.replay.mooncake import _NAMESPACE, _SESSION, ReplayResult, replay

#: TTL = this x the median gap between turns: a conversation slower than its median turn
#: still finds its blocks ranked high.
DEFAULT_TTL_FACTOR = 2.0
#: A TTL shorter than this is not set (and a TTL of 0 would mean "until the session ends").
MIN_TTL_SECONDS = 1.0


class HintRule(str, enum.Enum):
    NONE = "none"
    CONTINUE_TTL = "continue-ttl"


@dataclass(frozen=True)
class Retain:
    """One hint the rule set: after serving request `request`, at trace second `at`."""

    request: int
    continues: int  # the earlier request it continues
    at: float
    ttl: float
    applied: int  # blocks the store retained
    missing: int  # keys not cached when the hint came (evicted while serving the request)


@dataclass(frozen=True)
class HintSummary:
    rule: str
    ttl_factor: float
    continuations: int
    retains: int
    retained_blocks: int
    median_gap_seconds: float  # the last median, the one the last TTL came from
    hinted_at_end: int  # blocks whose hint still runs at the trace's end

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class ContinueTTL:
    """The `continue-ttl` rule (the module's docstring), as `replay`'s `after_request`."""

    def __init__(self, timestamps_ms: Sequence[int], factor: float = DEFAULT_TTL_FACTOR) -> None:
        if factor <= 0:
            raise ValueError(f"the TTL factor must be above 0, got {factor}")
        self.timestamps = timestamps_ms
        self.factor = factor
        self.now = 0.0
        self.retains: list[Retain] = []
        self.continuations = 0
        self.gaps: list[float] = []  # sorted
        self._latest: dict[bytes, int] = {}  # block key -> the latest request that held it
        self._lengths: list[int] = []
        self._store: BlockStore | None = None

    def clock(self) -> float:
        return self.now

    def __call__(self, index: int, keys: list[bytes], store: BlockStore) -> None:
        if self._store is None:  # no hint exists before the first call, so none read the clock
            self._store = store
            store.control.hints.clock = self.clock
        self.now = self.timestamps[index] / 1000
        earlier = self._continues(keys)
        for key in keys:
            self._latest[key] = index
        self._lengths.append(len(keys))
        if earlier is not None:
            self.continuations += 1
            bisect.insort(self.gaps, self.now - self.timestamps[earlier] / 1000)
            ttl = min(self.factor * self.median_gap(), MAX_TTL_SECONDS)
            if ttl >= MIN_TTL_SECONDS:
                result = store.control.retain(SessionId(_SESSION), _NAMESPACE, keys, Priority.HIGH, ttl)
                self.retains.append(Retain(index, earlier, self.now, ttl, result.applied, result.missing))
        if index + 1 < len(self.timestamps):  # the next request is served at its arrival
            self.now = self.timestamps[index + 1] / 1000

    def _continues(self, keys: list[bytes]) -> int | None:
        """The earlier request this one continues, if any (only requests already served)."""
        k = 0
        while k < len(keys) and keys[k] in self._latest:
            k += 1
        if k < 2:
            return None
        earlier = self._latest[keys[k - 1]]
        return earlier if k >= self._lengths[earlier] - 1 else None

    def median_gap(self) -> float:
        gaps, n = self.gaps, len(self.gaps)
        if not n:
            return 0.0
        return gaps[n // 2] if n % 2 else (gaps[n // 2 - 1] + gaps[n // 2]) / 2

    def summary(self) -> HintSummary:
        hinted = 0
        if self._store is not None:
            table = self._store.control.hints
            hinted = sum(1 for ref in table.hints if table.get(ref) is not None)
        return HintSummary(HintRule.CONTINUE_TTL.value, self.factor, self.continuations, len(self.retains),
                           sum(r.applied for r in self.retains), self.median_gap(), hinted)


def replay_with_hints(timed: Sequence[tuple[int, list[int]]], *, rule: HintRule | str = HintRule.CONTINUE_TTL,
                      ttl_factor: float = DEFAULT_TTL_FACTOR, **replay_options) -> tuple[ReplayResult, HintSummary | None]:
    """`replay` of (timestamp ms, hash_ids) requests with `rule` hinting after each one;
    `replay_options` are `replay`'s. With rule `none` it is `replay` itself (no summary)."""
    requests = [ids for _, ids in timed]
    if HintRule(rule) is HintRule.NONE:
        return replay(requests, **replay_options), None
    hinter = ContinueTTL([t for t, _ in timed], ttl_factor)
    result = replay(requests, after_request=hinter, **replay_options)
    return result, hinter.summary()
