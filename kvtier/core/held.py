"""Every copy a store holds, in the order a router can take them in: for KV events that
re-announce the whole state (a router that started late or lost messages, an engine that
joined a node-wide daemon, the pages adopted at a warm restart) and that take it back.

A router that hashes tokens drops a block whose parent it has not seen (llm-d does), so
parents come first: blocks in depth-first order from the roots of each prefix tree. Each
block is told first in its slowest tier, in one pass (every block gets known in its chain),
then its other copies tier by tier, in the same order, so consecutive blocks of a chain in
one tier still make one event.

The store's lock is taken per chunk of blocks, never for the whole walk: a daemon with a
million blocks keeps serving while it is read. A block that changes meanwhile is told as
it was when its chunk was read; a router's view is a hint, never trusted for data.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

from kvtier_client.tiers import Tier

from kvtier.core.index import Block, BlockIndex, Ref

#: Blocks read per hold of the store's lock.
CHUNK = 4096


@dataclass(frozen=True, slots=True)
class HeldCopy:
    tier: Tier
    namespace: str
    key: bytes
    parent: bytes | None
    tokens: tuple[int, ...] | None


@dataclass(slots=True)
class _Seen:
    ref: Ref
    parent: Ref | None
    tiers: tuple[Tier, ...]  # in place (not loading), and CLUSTER when known to be there
    tokens: tuple[int, ...] | None


def held_copies(index: BlockIndex, lock: threading.RLock, namespace: str | None = None) -> list[HeldCopy]:
    """The copies in place now (of one namespace, or all), parents first."""
    with lock:
        blocks: list[Block] = list(index.blocks.values())
    seen: dict[Ref, _Seen] = {}
    for start in range(0, len(blocks), CHUNK):
        with lock:
            for block in blocks[start:start + CHUNK]:
                if index.blocks.get(block.ref) is not block or (namespace is not None and block.ref[0] != namespace):
                    continue
                tiers = tuple(t for t, c in block.copies.items() if not c.loading)
                if block.in_cluster:
                    tiers += (Tier.CLUSTER,)
                if tiers:
                    seen[block.ref] = _Seen(block.ref, block.parent, tiers, block.tokens)
    order = _parents_first(seen)
    out = [_copy(b, max(b.tiers)) for b in order]
    for tier in Tier:
        out += [_copy(b, tier) for b in order if tier in b.tiers and tier != max(b.tiers)]
    return out


def _copy(seen: _Seen, tier: Tier) -> HeldCopy:
    namespace, key = seen.ref
    return HeldCopy(tier, namespace, key, seen.parent[1] if seen.parent else None, seen.tokens)


def _parents_first(seen: dict[Ref, _Seen]) -> list[_Seen]:
    """Depth-first from every root (a block whose parent is not held), children in the
    order they were filed."""
    children: defaultdict[Ref, list[_Seen]] = defaultdict(list)
    roots = []
    for block in seen.values():
        if block.parent is not None and block.parent in seen and block.parent != block.ref:
            children[block.parent].append(block)
        else:
            roots.append(block)
    order: list[_Seen] = []
    stack = list(reversed(roots))
    while stack:
        block = stack.pop()
        order.append(block)
        stack.extend(reversed(children.pop(block.ref, ())))
    return order
