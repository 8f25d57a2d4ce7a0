"""LookupGroups: a hybrid model's KV cache groups looked up in one call, each in its own
pool (docs/protocol.md, "Hybrid models"; kvtier.core.groups decides the answer and says
what is counted).

A group names its pool by page layout (unset: the pool of the session the request
names); the namespace is the session's for every group. That grants nothing new: a
session already reads its namespace in every pool (Explain), and keys never match across
namespaces. A layout no pool serves is NOT_FOUND, as an unknown pool is elsewhere: its
client has not registered (yet: after a daemon restart each group's client registers
again on its own).

The whole request is checked before any pool is read, so a bad one reads and counts
nothing. Then each pool is read under its own lock, one at a time (never two locks at
once: no lock order to keep), and a page may leave a pool between two reads. Like
Lookup, the answer is what was cached, not a hold: a page gone by the time it is
acquired is NotFound there. gRPC only: the fast lane has no frame for it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier_client.errors import InvalidArgument, NotFound
from kvtier_client.groups import GroupMode, check_group, check_lengths, mode_from_proto
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.protocol import check_known

from kvtier.core import BlockStore, check_keys
from kvtier.core.groups import GroupHoldings, match_groups
from kvtier.core.results import GroupsMatch
from kvtier.server.pools import Pool, PoolRegistry
from kvtier.server.sessions import Session
from kvtier.server.wire_guard import layout_of


@dataclass(frozen=True)
class _Group:
    """One requested group, checked: its pool's store, its keys and what it needs."""

    store: BlockStore
    keys: list[bytes]
    mode: GroupMode
    window: int


def lookup_groups(session: Session, pools: PoolRegistry, queries: Sequence[pb.GroupQuery],
                  known: int = 0) -> GroupsMatch:
    """The longest prefix every group can restore, and what each group needs for it;
    `known`: leading blocks the engine holds already (counted apart, not as hits)."""
    groups = [_group(i, query, session.pool, pools) for i, query in enumerate(queries)]
    try:
        check_known(known, check_lengths([len(group.keys) for group in groups]))
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    namespace = session.namespace
    held = [GroupHoldings(g.mode, g.window, g.store.holdings(namespace, g.keys)) for g in groups]
    match = match_groups(held)
    for group, pages in zip(groups, match.groups):
        group.store.count_group(namespace, group.keys, pages, match.hit_blocks, known)
    return match


def _group(i: int, query: pb.GroupQuery, own: Pool, pools: PoolRegistry) -> _Group:
    """Group `i` of a request, checked; every refusal names the group."""
    try:
        mode = mode_from_proto(query.mode)
        check_group(mode, query.window_blocks)
    except ValueError as exc:
        raise InvalidArgument(f"group {i}: {exc}") from None
    keys = list(query.keys)
    try:
        check_keys(keys)
        pool = _pool(query.layout, pools) if query.HasField("layout") else own
    except (InvalidArgument, NotFound) as exc:
        raise type(exc)(f"group {i}: {exc}") from None
    return _Group(pool.store, keys, mode, query.window_blocks)


def _pool(message: pb.PageLayout, pools: PoolRegistry) -> Pool:
    layout = layout_of(message)
    try:
        return pools.get(layout.layout_id)
    except NotFound:
        raise NotFound(f"no pool serves layout {layout!r}: register a client with this layout first (each KV cache "
                       "group of a hybrid model registers its own)") from None
