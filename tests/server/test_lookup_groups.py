"""LookupGroups against a real daemon: a hybrid model's three KV cache groups, each in its own
layout (so its own pool) and registered as its own session of one namespace — a full
attention group, a sliding-window group and a state (Mamba) group — looked up in one call.

Which pages each pool holds is set by what each test commits (never by timing); the one
eviction (test_evicted_early_window_pages_cost_nothing) runs on a daemon of its own, with
16 host pages per pool, no disk and LRU, so its victims follow from the counts alone.
"""
from __future__ import annotations

import grpc
import pytest
from kvtier_client import GroupLookup, GroupMode, GroupQuery, KVTierClient, NotFound, PageLayout, Tier
from kvtier_client.groups import GroupHit
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.wire import layout_from_proto
from rpc import LAYOUT, Conn, expect_code, keys, pool_stats, unchanged

FULL_LAYOUT = LAYOUT  # 3072-byte pages
WINDOW_LAYOUT = pb.PageLayout(layers=1, kv_heads=1, head_dim=32, block_tokens=16, dtype="float16", order="page_first")
STATE_LAYOUT = pb.PageLayout(layers=1, kv_heads=1, head_dim=64, block_tokens=16, dtype="float16", order="page_first")
HOST = pb.TIER_HOST


@pytest.fixture(scope="module")
def daemon(module_daemons):
    return module_daemons.start(host_size="1MiB", disk_size="0")


@pytest.fixture
def conn(daemon):
    conn = Conn(daemon.target)
    yield conn
    conn.close()


class Hybrid:
    """One namespace's three sessions, one per group layout, and each group's keys of the
    same 8 blocks (salted per group: a tag each)."""

    BLOCKS = 8

    def __init__(self, conn: Conn, namespace: str) -> None:
        self.conn = conn
        self.namespace = namespace
        self.full = conn.session(namespace, layout=FULL_LAYOUT)
        self.window = conn.session(namespace, layout=WINDOW_LAYOUT)
        self.state = conn.session(namespace, layout=STATE_LAYOUT)
        self.keys = {name: keys(f"{namespace}:{name}", self.BLOCKS) for name in ("full", "window", "state")}

    def put(self, group: str, blocks) -> None:
        """Commit this group's pages of `blocks` in its own pool."""
        getattr(self, group).put([self.keys[group][i] for i in blocks])

    def queries(self, window: int = 2) -> list[pb.GroupQuery]:
        """full (its own session's pool: no layout), window(n), state — each naming its layout."""
        return [
            pb.GroupQuery(keys=self.keys["full"], mode=pb.GROUP_FULL),
            pb.GroupQuery(keys=self.keys["window"], mode=pb.GROUP_WINDOW, window_blocks=window, layout=WINDOW_LAYOUT),
            pb.GroupQuery(keys=self.keys["state"], mode=pb.GROUP_STATE, layout=STATE_LAYOUT),
        ]

    def lookup(self, groups: list[pb.GroupQuery]) -> tuple[int, list[tuple[int, tuple[int, ...]]]]:
        """(hit_blocks, [(first_block, tiers)] per group) of a LookupGroups on the full group's session."""
        reply = self.full.call("LookupGroups", pb.LookupGroupsRequest(session_id=self.full.id, groups=groups))
        return reply.hit_blocks, [(g.first_block, tuple(g.tiers)) for g in reply.groups]

    def counts(self, group: str) -> tuple[int, int, int, dict[str, int]]:
        """(lookup_blocks, miss_blocks, host hits, misses by reason) of the namespace in a group's pool."""
        pool = pool_stats(self.conn.state(), getattr(self, group).reply.pool_id)
        ns = next((n for n in pool.namespaces if n.namespace == self.namespace), None)
        if ns is None:
            return 0, 0, 0, {}
        hits = next((t.hits for t in ns.tiers if t.tier == HOST), 0)
        return ns.lookup_blocks, ns.miss_blocks, hits, {reason: n for reason, n in ns.misses.items() if n}


def test_each_group_needs_only_its_part_of_the_prefix(conn):
    """The window group lacks its early blocks and the state group has only the last page:
    the whole prompt is still restorable, and each group is told its part."""
    h = Hybrid(conn, "whole")
    h.put("full", range(8))
    h.put("window", range(5, 8))
    h.put("state", [7])
    assert h.lookup(h.queries(window=2)) == (8, [(0, (HOST,) * 8), (6, (HOST,) * 2), (7, (HOST,))])
    # A plain Lookup of the window group's keys would have found nothing: its prefix misses block 0.
    assert h.window.lookup(h.keys["window"]).hit_blocks == 0


def test_a_hole_inside_the_window_ends_the_prefix_before_it(conn):
    """Block 6 of the window group is missing: no prefix whose trailing 3 blocks include it
    (e = 7, 8); e = 6 needs 3..5, held, and the state at block 5."""
    h = Hybrid(conn, "hole")
    h.put("full", range(8))
    h.put("window", [0, 1, 2, 3, 4, 5, 7])
    h.put("state", [5, 7])
    assert h.lookup(h.queries(window=3)) == (6, [(0, (HOST,) * 6), (3, (HOST,) * 3), (5, (HOST,))])


def test_state_falls_back_to_the_last_boundary_it_holds(conn):
    """No state at the end (block 7): the prefix ends where the state group last saved one."""
    h = Hybrid(conn, "state")
    h.put("full", range(8))
    h.put("window", range(8))
    h.put("state", [2, 5])
    assert h.lookup(h.queries(window=2)) == (6, [(0, (HOST,) * 6), (4, (HOST,) * 2), (5, (HOST,))])


def test_a_group_with_nothing_cached_gives_no_prefix(conn):
    h = Hybrid(conn, "absent")
    h.put("full", range(8))
    h.put("window", range(8))  # the state group stored nothing
    assert h.lookup(h.queries()) == (0, [(0, ()), (0, ()), (0, ())])


def test_each_group_is_counted_in_its_own_pool(conn):
    """Hits: the pages a group needs for the answer. Misses: every block after the answer
    (with its reason). Blocks before a window or the state are neither."""
    h = Hybrid(conn, "counts")
    h.put("full", range(8))
    h.put("window", range(2, 7))
    h.put("state", [3, 6])
    assert h.lookup(h.queries(window=2))[0] == 7
    # full: blocks 0..6 hit, block 7 missed though cached (beyond the prefix).
    assert h.counts("full") == (8, 1, 7, {"beyond_prefix": 1})
    # window: blocks 5, 6 hit, block 7 never stored; blocks 0..4 are not needed.
    assert h.counts("window") == (3, 1, 2, {"never_stored": 1})
    # state: block 6 hit, block 7 never stored.
    assert h.counts("state") == (2, 1, 1, {"never_stored": 1})


def test_one_full_group_counts_as_a_lookup(conn):
    one, two = Hybrid(conn, "lookup-one"), Hybrid(conn, "lookup-two")
    for h in (one, two):
        h.put("full", range(5))
    one.full.lookup(one.keys["full"])
    assert two.lookup([pb.GroupQuery(keys=two.keys["full"], mode=pb.GROUP_FULL)]) == (5, [(0, (HOST,) * 5)])
    assert one.counts("full") == two.counts("full") == (8, 3, 5, {"never_stored": 3})


def test_evicted_early_window_pages_cost_nothing(daemons):
    d = daemons.start("--policy", "lru", host_size="64KiB", disk_size="0")  # 16 pages per pool
    conn = Conn(d.target)
    try:
        h = Hybrid(conn, "evicted")
        h.put("full", range(8))
        h.put("window", range(4))
        h.put("window", range(4, 8))
        h.put("state", [7])
        h.window.release(h.window.borrow(12).lease_id)  # 8 free pages, 4 evicted: the oldest, blocks 0..3
        assert h.window.lookup(h.keys["window"][4:]).hit_blocks == 4
        assert h.window.lookup(h.keys["window"]).hit_blocks == 0
        assert h.lookup(h.queries(window=4)) == (8, [(0, (HOST,) * 8), (4, (HOST,) * 4), (7, (HOST,))])
    finally:
        conn.close()


@pytest.mark.parametrize(("change", "says"), [
    (lambda q: q[2].keys.pop(), "every group gives one key per block of the same prefix"),
    (lambda q: setattr(q[1], "window_blocks", 0), "group 1: a WINDOW group needs window >= 1"),
    (lambda q: setattr(q[2], "window_blocks", 3), "group 2: window applies to WINDOW groups only"),
    (lambda q: setattr(q[0], "mode", pb.GROUP_MODE_UNSPECIFIED), "group 0: a group's mode is unspecified"),
    (lambda q: setattr(q[0], "mode", 9), "group 0: unknown group mode 9"),
    (lambda q: setattr(q[1].layout, "dtype", "float12"), "group 1: page layout: unknown dtype 'float12'"),
    (lambda q: setattr(q[1].layout, "layers", 0), "group 1: page layout: layers must be a positive integer"),
    (lambda q: q[1].keys.__setitem__(3, b""), "group 1: key 3 must be 1 to"),
    (lambda q: q.clear(), "needs at least one group"),
], ids=["lengths", "window 0", "window on a state group", "no mode", "unknown mode", "dtype", "layers", "empty key",
        "no groups"])
def test_a_bad_request_is_refused_and_changes_nothing(conn, change, says):
    h = Hybrid(conn, "bad")
    h.put("full", range(8))
    queries = h.queries()
    change(queries)
    request = pb.LookupGroupsRequest(session_id=h.full.id, groups=queries)
    with unchanged(conn):
        message = expect_code(grpc.StatusCode.INVALID_ARGUMENT, h.full.call, "LookupGroups", request)
    assert says in message


def test_a_layout_no_pool_serves_is_not_found(conn):
    h = Hybrid(conn, "unserved")
    queries = h.queries()
    queries[1].layout.head_dim = 16  # nobody registered this layout
    with unchanged(conn):
        message = expect_code(grpc.StatusCode.NOT_FOUND, h.full.call, "LookupGroups",
                              pb.LookupGroupsRequest(session_id=h.full.id, groups=queries))
    assert "group 1: no pool serves layout" in message and "register a client with this layout" in message


def test_lookup_groups_is_guarded_like_every_session_call(conn):
    """The session's key is checked, and the session's namespace bounds every group."""
    h = Hybrid(conn, "guarded")
    request = pb.LookupGroupsRequest(session_id=h.full.id, groups=h.queries())
    for key in ("", "0" * 32):
        expect_code(grpc.StatusCode.PERMISSION_DENIED, conn.call, "LookupGroups", request, key=key)
    message = expect_code(grpc.StatusCode.NOT_FOUND, conn.call, "LookupGroups",
                          pb.LookupGroupsRequest(session_id="0" * 32, groups=h.queries()))
    assert "register again" in message
    # Every group is looked up in the session's namespace: another's keys are never seen.
    for group in ("full", "window", "state"):
        h.put(group, range(8))
    assert h.lookup(h.queries())[0] == 8
    stranger = conn.session("stranger", layout=FULL_LAYOUT)
    reply = stranger.call("LookupGroups", pb.LookupGroupsRequest(session_id=stranger.id, groups=h.queries()))
    assert reply.hit_blocks == 0


def test_the_client_call(daemon):
    """One KVTierClient per group layout; the call goes through any of them, and each
    group's hit names the keys to acquire from its own client."""
    layouts = {name: layout_from_proto(m) for name, m in
               (("full", FULL_LAYOUT), ("window", WINDOW_LAYOUT), ("state", STATE_LAYOUT))}
    group_keys = {name: keys(f"client:{name}", 6) for name in layouts}
    clients = {name: KVTierClient(daemon.target, name=f"hybrid-{name}") for name in layouts}
    try:
        for name, client in clients.items():
            client.register("client", layouts[name])
        for name, blocks in (("full", range(6)), ("window", range(2, 6)), ("state", [3])):
            with clients[name].borrow(len(blocks)) as lease:
                lease.commit([group_keys[name][i] for i in blocks])
        groups = [
            GroupQuery(group_keys["full"], GroupMode.FULL, layout=layouts["full"]),
            GroupQuery(group_keys["window"], GroupMode.WINDOW, window=2, layout=layouts["window"]),
            GroupQuery(group_keys["state"], GroupMode.STATE),  # no layout: the calling client's own
        ]
        found = clients["state"].lookup_groups(groups)
        assert found == GroupLookup(4, (GroupHit(0, (Tier.HOST,) * 4), GroupHit(2, (Tier.HOST,) * 2),
                                        GroupHit(3, (Tier.HOST,))))
        assert found.groups[1].blocks == range(2, 4)
        for name, hit in zip(("full", "window", "state"), found.groups):
            with clients[name].acquire(hit.hit_keys(group_keys[name])) as lease:
                assert lease.count == len(hit.tiers)
        # What the daemon would refuse, the client refuses before sending.
        with pytest.raises(ValueError, match="a WINDOW group needs window >= 1"):
            GroupQuery(group_keys["window"], GroupMode.WINDOW)
        with pytest.raises(ValueError, match="every group gives one key per block"):
            clients["full"].lookup_groups([groups[0], GroupQuery(group_keys["state"][:3], GroupMode.STATE)])
        unserved = PageLayout(layers=3, kv_heads=1, head_dim=48, block_tokens=16)
        with pytest.raises(NotFound, match="no pool serves layout"):
            clients["full"].lookup_groups([GroupQuery(group_keys["full"], GroupMode.FULL, layout=unserved)])
    finally:
        for client in clients.values():
            client.close()
