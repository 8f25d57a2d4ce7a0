"""What the daemon tells about its blocks: one record per copy that arrives in or leaves a
tier, and the events those records become once the publisher has grouped them.

A record is a plain tuple, made under a store's lock (kvtier.events.sink): the cheapest
thing Python builds (a named tuple costs several times as much). `coalesce` turns the records of one drain into events
per namespace, merging what vLLM sends as one event: consecutive copies of one prefix chain
arriving in one tier (one BlockStored with every block's hash and all their token ids), and
consecutive departures from one tier (one BlockRemoved).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier_client.tiers import Tier

#: One copy of one block arriving in (stored True) or leaving a tier:
#: (stored, tier, namespace, key, parent, the block's token ids, tokens per block).
Record = tuple[bool, Tier, str, bytes, bytes | None, tuple[int, ...] | None, int]


class EventKind(enum.Enum):
    STORED = "stored"  # copies of `keys` arrived in `tier`
    REMOVED = "removed"  # copies of `keys` left `tier`
    CLEARED = "cleared"  # every copy of the namespace is gone (the daemon stopped)


@dataclass(slots=True)
class Event:
    """One event of one namespace. STORED: `keys` is a prefix chain in order, `parent` the
    key before keys[0] (None: a root, or not known), `token_ids` every block's token ids
    in order (None when the client passed none at commit)."""

    kind: EventKind
    namespace: str
    tier: Tier | None
    keys: list[bytes]
    parent: bytes | None = None
    token_ids: list[int] | None = None
    block_size: int = 0

    @property
    def blocks(self) -> int:
        """How many block events (records) this stands for; a CLEARED counts one."""
        return len(self.keys) or 1


def coalesce(records: list[Record]) -> dict[str, list[Event]]:
    """Each namespace's events, in the order its records were made."""
    out: dict[str, list[Event]] = {}
    for stored, tier, namespace, key, parent, tokens, block_size in records:
        events = out.setdefault(namespace, [])
        last = events[-1] if events else None
        if stored:
            if (last is not None and last.kind is EventKind.STORED and last.tier is tier
                    and last.block_size == block_size and last.keys[-1] == parent
                    and (last.token_ids is None) == (tokens is None)):
                last.keys.append(key)
                if tokens is not None:
                    last.token_ids.extend(tokens)
            else:
                ids = list(tokens) if tokens is not None else None
                events.append(Event(EventKind.STORED, namespace, tier, [key], parent, ids, block_size))
        elif last is not None and last.kind is EventKind.REMOVED and last.tier is tier:
            last.keys.append(key)
        else:
            events.append(Event(EventKind.REMOVED, namespace, tier, [key]))
    return out
