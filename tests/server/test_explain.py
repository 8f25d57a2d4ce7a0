"""Explain and `kvtier stats why` on a real daemon with a constructed history: one prompt of
seven blocks whose blocks are, in order, cached, cached, evicted by another namespace's
pressure, dropped as corrupt, never stored (but committed under sha256), cached beyond
the prefix, and cached only in another layout of the same namespace.

Host and disk hold 16 pages each, so every eviction below is forced by a count, not by
timing."""
from __future__ import annotations

import json

import grpc
import pytest
from kvtier_client import KVTierClient, PageLayout
from kvtier_client.keys import block_keys
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.results import BlockReason
from kvtier_client.tiers import Tier
from rpc import LAYOUT, Conn, expect_code, free_port, keys, pool_stats, run_kvtier, scrape, value
from test_async_loads import disk_offset

#: A second layout (4096-byte pages) for the same namespace: a pool of its own.
OTHER_LAYOUT = pb.PageLayout(layers=1, kv_heads=1, head_dim=64, block_tokens=16, dtype="float16", order="page_first")
TOKENS = list(range(7 * 16))
K = block_keys(TOKENS, 16)  # xxh3-128, what the "ex" clients use
SHA = block_keys(TOKENS, 16, algorithm="sha256")
EXPECTED = [
    (pb.BLOCK_CACHED, pb.TIER_HOST),
    (pb.BLOCK_CACHED, pb.TIER_HOST),
    (pb.BLOCK_EVICTED, pb.TIER_DISK),
    (pb.BLOCK_CORRUPT, pb.TIER_DISK),
    (pb.BLOCK_NEVER_STORED, pb.TIER_UNSPECIFIED),
    (pb.BLOCK_BEYOND_PREFIX, pb.TIER_HOST),
    (pb.BLOCK_OTHER_LAYOUT, pb.TIER_HOST),
]


def flip_disk_page(daemon, pool: str, namespace: str, key: bytes, slot_bytes: int) -> None:
    """Invert the first bytes of a page in the slab file: its checksum no longer matches."""
    at = disk_offset(daemon.cache_dir, pool, namespace, key, slot_bytes)
    with open(daemon.cache_dir / pool / "slab.bin", "r+b") as slab:
        slab.seek(at)
        head = slab.read(64)
        slab.seek(at)
        slab.write(bytes(b ^ 0xFF for b in head))


@pytest.fixture(scope="module")
def history(module_daemons):
    """The daemon, the "ex" session (xxh3-128, LAYOUT) and the two pool ids, after the history."""
    port = free_port()
    # The explanations checked below follow LRU's eviction order.
    d = module_daemons.start("--metrics-port", str(port), "--policy", "lru", host_size="64KiB", disk_size="64KiB")
    conn = Conn(d.target)
    ex = conn.session("ex")
    pool = ex.reply.pool_id
    ex.put([K[2], K[3]])
    ex.release(ex.borrow(16).lease_id)  # both go down to disk
    flip_disk_page(d, pool, "ex", K[3], ex.reply.slot_bytes)
    expect_code(grpc.StatusCode.NOT_FOUND, ex.acquire, [K[3]])  # the read finds it corrupt: dropped
    other = conn.session("other")
    other.put(keys("other", 16))
    other.put(keys("other-2", 16))  # demotes 16 pages into the disk: K[2] is evicted from it
    ex.put([K[0], K[1]])
    ex.put([K[5]])
    other_layout = conn.session("ex", layout=OTHER_LAYOUT)
    other_layout.put([K[6]])
    conn.session("ex", algorithm="sha256").put([SHA[4]])
    yield d, port, ex, pool, other_layout.reply.pool_id
    conn.close()


def states(reply: pb.ExplainResponse) -> list[tuple[int, int]]:
    return [(b.state, b.tier) for b in reply.blocks]


def test_each_state_through_the_session(history):
    d, _, ex, pool, pool2 = history
    reply = ex.call("Explain", pb.ExplainRequest(session_id=ex.id, keys=K))
    assert states(reply) == EXPECTED
    assert reply.hit_blocks == 2
    assert [b.index for b in reply.blocks] == list(range(7))
    assert [b.pool_id for b in reply.blocks] == [pool] * 6 + [pool2]
    evicted = reply.blocks[2]
    assert (evicted.policy, evicted.own_pressure) == ("lru", False)  # the "other" namespace's demotions
    assert 0 <= evicted.seconds_ago < 60 and 0 <= reply.blocks[3].seconds_ago < 60
    assert list(reply.hashings) == ["sha256 16 tokens/block", "xxh3-128 16 tokens/block"]


def test_by_namespace_and_pool(history, connect):
    d, _, ex, pool, pool2 = history
    conn = connect(d.target)
    # No pool named: the pool serving the longest prefix answers.
    assert states(conn.call("Explain", pb.ExplainRequest(namespace="ex", keys=K))) == EXPECTED
    # The other layout's pool: blocks the first pool holds are "in another layout" there.
    reply = conn.call("Explain", pb.ExplainRequest(namespace="ex", keys=K, pool_id=pool2))
    assert reply.hit_blocks == 0
    assert [b.state for b in reply.blocks] == [
        pb.BLOCK_OTHER_LAYOUT, pb.BLOCK_OTHER_LAYOUT, pb.BLOCK_NEVER_STORED, pb.BLOCK_NEVER_STORED,
        pb.BLOCK_NEVER_STORED, pb.BLOCK_OTHER_LAYOUT, pb.BLOCK_BEYOND_PREFIX,
    ]
    assert [b.pool_id for b in reply.blocks] == [pool, pool, pool2, pool2, pool2, pool, pool2]
    # Another namespace sees nothing of ex's history.
    blank = conn.call("Explain", pb.ExplainRequest(namespace="stranger", keys=K, pool_id=pool))
    assert [b.state for b in blank.blocks] == [pb.BLOCK_NEVER_STORED] * 7 and not blank.hashings
    expect_code(grpc.StatusCode.NOT_FOUND, conn.call, "Explain", pb.ExplainRequest(namespace="ex", keys=K, pool_id="nope"))
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, conn.call, "Explain", pb.ExplainRequest(keys=K))
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, conn.call, "Explain", pb.ExplainRequest(namespace="ex", keys=[b""]))
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, ex.call, "Explain",
                pb.ExplainRequest(session_id=ex.id, namespace="other", keys=K))


def test_explain_counts_nothing_and_lookup_counts_reasons(history):
    d, port, ex, pool, _ = history

    def usage() -> pb.NamespaceStats:
        return next(n for n in pool_stats(ex.conn.state(), pool).namespaces if n.namespace == "ex")

    before = usage()
    ex.call("Explain", pb.ExplainRequest(session_id=ex.id, keys=K))
    assert usage() == before
    assert ex.lookup(K).hit_blocks == 2
    after = usage()
    assert after.lookup_blocks - before.lookup_blocks == 7
    moved = {reason: after.misses[reason] - before.misses[reason] for reason in after.misses}
    assert moved == {"never_stored": 2, "evicted": 1, "corrupt": 1, "beyond_prefix": 1, "dropped": 0}  # K[6]: never in this pool
    _, families = scrape(port)
    for reason, count in after.misses.items():
        if count:
            assert value(families, "kvtier_misses_total", pool=pool, kvtier_namespace="ex", reason=reason) == count


def test_stats_why_with_keys(history):
    d, _, _, pool, pool2 = history
    out = run_kvtier("stats", "why", "--socket", str(d.socket), "--namespace", "ex", *(k.hex() for k in K))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    print(out.stdout)
    assert lines[0] == f"namespace ex, pool {pool}: 2 of 7 blocks served (the longest cached prefix)"
    rows = lines[1:8]
    assert [r.split()[0] for r in rows] == [str(i) for i in range(7)]
    assert [r.split()[1] for r in rows] == [k.hex()[:12] for k in K]
    assert rows[0].endswith("cached in host") and rows[1].endswith("cached in host")
    assert "evicted from disk" in rows[2] and "s ago by lru (another namespace's pressure)" in rows[2]
    assert "dropped as corrupt from disk" in rows[3]
    assert rows[4].endswith("never stored")
    assert rows[5].endswith("cached in host, but beyond the longest cached prefix")
    assert rows[6].endswith(f"cached in another layout {pool2} (host)")
    assert lines[8] == ("7 blocks: 2 cached, 1 evicted, 1 dropped as corrupt, 1 never stored, 1 in another layout, "
                        "1 beyond the prefix")
    assert lines[9] == "clients of ex registered with: sha256 16 tokens/block, xxh3-128 16 tokens/block"


def test_stats_why_with_tokens(history, tmp_path):
    d, _, _, pool, _ = history
    listed = ",".join(map(str, TOKENS))
    out = run_kvtier("stats", "why", "--socket", str(d.socket), "--namespace", "ex", "--tokens", listed,
                     "--block-tokens", "16")
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    lines = out.stdout.splitlines()
    assert lines[5].endswith("committed under another hash fingerprint (sha256)")
    assert lines[8].endswith("1 under another hash fingerprint")
    assert lines[9] == ("clients of ex registered with: sha256 16 tokens/block, xxh3-128 16 tokens/block; "
                        "you asked for xxh3-128 16 tokens/block")

    # The same from a file, as JSON, with the block size taken from --pool.
    token_file = tmp_path / "prompt.txt"
    token_file.write_text("\n".join(" ".join(map(str, TOKENS[i : i + 10])) for i in range(0, len(TOKENS), 10)))
    out = run_kvtier("stats", "--socket", str(d.socket), "why", "--namespace", "ex", "--tokens-file", str(token_file),
                     "--pool", pool, "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["hit_blocks"] == 2 and data["asked"] == "xxh3-128 16 tokens/block"
    assert [b["state"] for b in data["blocks"]] == ["cached", "cached", "evicted", "corrupt", "never_stored",
                                                    "beyond_prefix", "other_layout"]
    assert [b["key"] for b in data["blocks"]] == [k.hex() for k in K]
    assert data["blocks"][4]["other_algorithm"] == "sha256"
    assert data["blocks"][2]["tier"] == "disk" and data["blocks"][2]["policy"] == "lru"


def test_stats_why_refuses_bad_input(history):
    d, _, _, _, _ = history
    base = ("stats", "why", "--socket", str(d.socket), "--namespace", "ex")
    for args, message in (
        ((), "give the block KEYs"),
        (("zz",), "keys are hex strings"),
        (("--tokens", "1,x"), "token ids are integers"),
        (("--tokens", "1,2", K[0].hex()), "give the block KEYs"),
        (("--tokens", "1,2"), "--tokens needs --block-tokens"),  # two pools: which block size?
    ):
        out = run_kvtier(*base, *args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    out = run_kvtier("stats", "--watch", "1", "why", "--socket", str(d.socket), "--namespace", "ex", K[0].hex())
    assert out.returncode == 2 and "--watch" in out.stderr


def test_client_explain(history):
    d, _, _, _, pool2 = history
    layout = PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16, dtype="float16")
    assert LAYOUT.head_dim == layout.head_dim  # the "ex" session's layout
    with KVTierClient(d.target, name="explain-test") as kv:
        kv.register("ex", layout)
        ex = kv.explain(K)
    assert ex.hit_blocks == 2
    assert [b.reason for b in ex.blocks] == [
        BlockReason.CACHED, BlockReason.CACHED, BlockReason.EVICTED, BlockReason.CORRUPT, BlockReason.NEVER_STORED,
        BlockReason.BEYOND_PREFIX, BlockReason.OTHER_LAYOUT,
    ]
    assert [b.tier for b in ex.blocks] == [Tier.HOST, Tier.HOST, Tier.DISK, Tier.DISK, None, Tier.HOST, Tier.HOST]
    assert ex.blocks[6].pool_id == pool2
    assert ex.blocks[2].policy == "lru" and not ex.blocks[2].own_pressure
    assert "xxh3-128 16 tokens/block" in ex.hashings
