"""Hybrid models: what each KV cache group needs of a prefix, and the typed request and
answer of one lookup over all the groups (KVTierClient.lookup_groups; the daemon's
LookupGroups, docs/protocol.md "Hybrid models").

A hybrid model (vLLM's hybrid KV cache: full attention, sliding window, chunked local
attention, Mamba or linear attention layers) keeps one page layout per KV cache group, so
each group's pages live in their own pool. The first e blocks of a prompt can be restored
when every group has what its layers read, here for e = 6:

    block            0   1   2   3   4   5
    FULL             x   x   x   x   x   x    every block of the prefix, [0, e)
    WINDOW(n=2)                      x   x    the trailing n blocks, [max(0, e - n), e)
    STATE                                x    the state at the prefix's end, block e - 1

What a group needs is always the trailing `needed_blocks(mode, window, e)` of the prefix.
Both sides use these rules: the client checks a query as it is built, the daemon checks
what arrives (its ValueError becomes INVALID_ARGUMENT), so they cannot disagree.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier_client.keys import BlockKey
from kvtier_client.layout import PageLayout
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.tiers import Tier
from kvtier_client.wire import layout_to_proto, tier_from_proto


class GroupMode(enum.Enum):
    """What a group needs of a prefix. The values are the proto's GroupMode numbers."""

    FULL = pb.GROUP_FULL  # every block
    WINDOW = pb.GROUP_WINDOW  # the trailing `window` blocks
    STATE = pb.GROUP_STATE  # the last block's page only (its recurrent state)


def check_group(mode: GroupMode, window: int) -> None:
    """A group's mode and window as both sides accept them; ValueError otherwise."""
    if mode is GroupMode.WINDOW and window < 1:
        raise ValueError(f"a WINDOW group needs window >= 1 (the trailing blocks its layers read), got {window}")
    if mode is not GroupMode.WINDOW and window != 0:
        raise ValueError(f"window applies to WINDOW groups only; pass 0 for a {mode.name} group, got {window}")


def mode_from_proto(value: int) -> GroupMode:
    """The daemon's reading of GroupQuery.mode; ValueError for unspecified or unknown."""
    if value == pb.GROUP_MODE_UNSPECIFIED:
        raise ValueError("a group's mode is unspecified; say what it needs: GROUP_FULL, GROUP_WINDOW or GROUP_STATE")
    try:
        return GroupMode(value)
    except ValueError:
        raise ValueError(f"unknown group mode {value}; use GROUP_FULL, GROUP_WINDOW or GROUP_STATE") from None


def check_lengths(lengths: Sequence[int]) -> int:
    """Every group gives one key per block of the same prefix: their common length, or
    ValueError."""
    if not lengths:
        raise ValueError("a group lookup needs at least one group")
    if len(set(lengths)) > 1:
        raise ValueError(f"every group gives one key per block of the same prefix, but they gave {list(lengths)} keys; "
                         "pass each group's keys of the same blocks")
    return lengths[0]


def needed_blocks(mode: GroupMode, window: int, end: int) -> range:
    """The blocks a group needs to restore the first `end` blocks (none for end 0)."""
    if end == 0:
        return range(0)
    if mode is GroupMode.FULL:
        return range(end)
    if mode is GroupMode.WINDOW:
        return range(max(0, end - window), end)
    return range(end - 1, end)


@dataclass(frozen=True)
class GroupQuery:
    """One group of a group lookup: its key of each block (salted for this group, so
    groups sharing a layout never share pages), what it needs, and its pool's layout
    (None: the layout of the client making the call)."""

    keys: Sequence[BlockKey]
    mode: GroupMode
    window: int = 0  # WINDOW: the trailing blocks the group's layers read (>= 1)
    layout: PageLayout | None = None

    def __post_init__(self) -> None:
        check_group(self.mode, self.window)

    def to_proto(self) -> pb.GroupQuery:
        message = pb.GroupQuery(keys=list(self.keys), mode=self.mode.value, window_blocks=self.window)
        if self.layout is not None:
            message.layout.CopyFrom(layout_to_proto(self.layout))
        return message


@dataclass(frozen=True)
class GroupHit:
    """What one group needs loaded to restore the prefix: `blocks` (a trailing range of
    it) and the fastest tier holding each."""

    first_block: int
    tiers: tuple[Tier, ...]

    @property
    def blocks(self) -> range:
        return range(self.first_block, self.first_block + len(self.tiers))

    def hit_keys(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """This group's keys of `blocks` (`keys`: the group's keys the lookup was for):
        what to acquire from its pool."""
        return list(keys[self.first_block : self.first_block + len(self.tiers)])


@dataclass(frozen=True)
class GroupLookup:
    """The first `hit_blocks` blocks can be restored; `groups[i]` is what group i needs
    for that, in the order the groups were asked."""

    hit_blocks: int
    groups: tuple[GroupHit, ...]

    @classmethod
    def from_proto(cls, reply: pb.LookupGroupsResponse) -> "GroupLookup":
        return cls(reply.hit_blocks, tuple(
            GroupHit(g.first_block, tuple(tier_from_proto(t) for t in g.tiers)) for g in reply.groups))
