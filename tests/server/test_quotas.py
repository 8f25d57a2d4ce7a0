"""Quotas from the tokens file against real daemons: a guarantee keeps a quiet tenant's hot
set while another tenant floods commits from its own process, a maximum makes a namespace
evict its own pages, and Stats, metrics and `kvtier stats` show each namespace's share
only to tokens that grant it."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import grpc
import pytest
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import expect_code, free_port, keys, pool_stats, run_kvtier, scrape, unchanged, value

from kvtier.admin import render_stats

QUIET = "token-quiet-3f9a1c7e5b2d4f60"
FLOOD = "token-flood-8e2d6a4c1b9f7e35"
CAPPED = "token-capped-5a7c9e1b3d5f7a9c"
BYSTANDER = "token-bystander-2b4d6f8a0c2e4a6b"
ADMIN = "token-admin-9c8b7a6f5e4d3c2b"

HOT = 32  # the quiet tenant's hot set, in pages
HOST_PAGES = 64  # host_size 256KiB of 4096-byte slots
ROUNDS = 40
THINK = 0.05  # seconds between the quiet tenant's requests: the flood commits ~100+ pages meanwhile

#: The flooding tenant: a client process of its own, committing fresh pages as fast as it can.
FLOOD_CLIENT = textwrap.dedent("""
    import itertools, sys
    from kvtier_client import KVTierClient, KVTierError, PageLayout
    layout = PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16, dtype="float16")
    with KVTierClient(sys.argv[1], token=sys.argv[2], name="flood") as kv:
        kv.register("flood", layout)
        print("ready", flush=True)
        for i in itertools.count():
            try:
                with kv.borrow(8) as lease:
                    lease.commit([i.to_bytes(8, "little") + j.to_bytes(8, "little") for j in range(8)])
            except KVTierError:
                pass  # no room this moment (every page leased): try again
""")


def tokens_file(path, quotas: str = "") -> str:
    path.write_text(textwrap.dedent(f"""
        [tokens]
        "{QUIET}" = ["quiet"]
        "{FLOOD}" = ["flood"]
        "{CAPPED}" = ["capped"]
        "{BYSTANDER}" = ["bystander"]
        "{ADMIN}" = ["*"]
    """) + textwrap.dedent(quotas))
    return str(path)


def namespace(state: pb.StatsResponse, pool: str, name: str) -> pb.NamespaceStats:
    return next(n for n in pool_stats(state, pool).namespaces if n.namespace == name)


def host(ns: pb.NamespaceStats) -> pb.NamespaceTierStats:
    return next(t for t in ns.tiers if t.tier == pb.TIER_HOST)


def quiet_hit_rate(daemons, connect, tmp_path, name: str, quotas: str,
                   *args: str) -> tuple[float, pb.StatsResponse]:
    """Run the quiet tenant against the flood on a fresh daemon (host tier only, so an
    evicted page is gone); returns the quiet tenant's block hit rate and the final Stats."""
    d = daemons.start("--tokens-file", tokens_file(tmp_path / f"{name}.toml", quotas), *args, name=name,
                      host_size="256KiB", disk_size="0")
    quiet = connect(d.target, token=QUIET).session("quiet")
    hot = keys("hot", HOT)
    quiet.put(hot)
    flood = daemons.child(subprocess.Popen([sys.executable, "-c", FLOOD_CLIENT, d.target, FLOOD],
                                           stdout=subprocess.PIPE, text=True))
    assert flood.stdout.readline().strip() == "ready"
    hits = 0
    for _ in range(ROUNDS):
        time.sleep(THINK)
        hit = quiet.lookup(hot).hit_blocks
        hits += hit
        if hit:
            quiet.release(quiet.acquire(hot[:hit]).lease_id)
        if hit < HOT:  # an engine recomputes what missed and commits it again
            quiet.put(hot[hit:])
    flood.kill()
    flood.wait()
    admin = connect(d.target, token=ADMIN)
    return hits / (ROUNDS * HOT), admin.state()


def test_guarantee_keeps_the_quiet_tenants_hot_set(daemons, connect, tmp_path):
    guaranteed = f"""
        [namespaces.quiet]
        guaranteed_host_pages = {HOT}
    """
    # Without a quota the flood is measured under LRU, where recency alone decides: the default
    # frecency already favours a hot set used 40 times over pages used once, by an amount that
    # depends on how fast each side runs (0.54 seen in CI), which would make this baseline flaky.
    # The guarantee itself is measured under the default policy.
    without, plain = quiet_hit_rate(daemons, connect, tmp_path, "plain", "", "--policy", "lru")
    with_guarantee, guarded = quiet_hit_rate(daemons, connect, tmp_path, "kept", guaranteed)
    print(f"\nquiet tenant block hit rate under a flood: {without:.3f} without quotas, "
          f"{with_guarantee:.3f} with guaranteed_host_pages = {HOT} (hot set {HOT} of {HOST_PAGES} host pages)")
    print(render_stats(plain), render_stats(guarded), sep="\n")
    for state in (plain, guarded):
        (pool,) = state.pools
        assert host(namespace(state, pool.pool_id, "flood")).evictions > HOST_PAGES  # the flood really ran
        quiet = namespace(state, pool.pool_id, "quiet")
        assert quiet.lookup_blocks == ROUNDS * HOT
    assert without < 0.5
    assert with_guarantee > 0.95
    (pool,) = guarded.pools
    quiet = namespace(guarded, pool.pool_id, "quiet")
    assert host(quiet).guaranteed_pages == HOT and host(quiet).pages == HOT
    assert host(quiet).evictions == 0
    assert host(quiet).hits / quiet.lookup_blocks == pytest.approx(with_guarantee)


@pytest.fixture(scope="module")
def capped(module_daemons, tmp_path_factory):
    """A daemon where namespace "capped" may hold 8 host pages, with a metrics endpoint."""
    port = free_port()
    path = tokens_file(tmp_path_factory.mktemp("capped") / "tokens.toml", """
        [namespaces.capped]
        max_host_pages = 8
    """)
    d = module_daemons.start("--tokens-file", path, "--metrics-port", str(port), host_size="256KiB", disk_size="1MiB")
    return d, port


def test_a_namespace_at_its_maximum_evicts_its_own_pages(capped, connect):
    d, port = capped
    bystander = connect(d.target, token=BYSTANDER).session("bystander")
    bystander.put(keys("bystander", 16))
    mine = connect(d.target, token=CAPPED).session("capped")
    pool = mine.reply.pool_id
    first, second = keys("capped-1", 8), keys("capped-2", 8)
    mine.put(first)
    admin = connect(d.target, token=ADMIN)
    before = namespace(admin.state(), pool, "bystander")
    mine.put(second)  # at its maximum: makes room by evicting its own first 8 (down to disk)
    assert mine.lookup(second).hit_blocks == 8
    assert list(mine.lookup(first).tiers) == [pb.TIER_DISK] * 8
    with unchanged(admin):
        expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, mine.borrow, 9)  # more than it may ever hold

    state = admin.state()
    ns = namespace(state, pool, "capped")
    assert (host(ns).pages, host(ns).max_pages, host(ns).guaranteed_pages, host(ns).evictions) == (8, 8, 0, 8)
    assert namespace(state, pool, "bystander") == before  # the other tenant's counts did not move
    assert host(before).pages == 16 and host(before).evictions == 0

    _, families = scrape(port)
    labels = {"pool": pool, "kvtier_namespace": "capped"}
    assert value(families, "kvtier_namespace_pages", **labels, tier="host") == 8
    assert value(families, "kvtier_namespace_pages", **labels, tier="disk") == 8
    assert value(families, "kvtier_namespace_quota_pages", **labels, tier="host", kind="max") == 8
    assert value(families, "kvtier_namespace_evictions_total", **labels, tier="host") == 8
    assert value(families, "kvtier_namespace_hits_total", **labels, tier="host") == 8
    assert value(families, "kvtier_namespace_hits_total", **labels, tier="disk") == 8
    assert value(families, "kvtier_namespace_evictions_total", pool=pool, kvtier_namespace="bystander", tier="host") == 0
    assert value(families, "kvtier_namespace_pages", pool=pool, kvtier_namespace="bystander", tier="host") == 16

    out = run_kvtier("stats", "--socket", str(d.socket), env={"KVTIER_TOKEN": ADMIN})
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("  capped ")]
    # namespace tier pages max guaranteed hits evicted looked up, then misses by reason
    assert rows[0][:8] == ["capped", "host", "8", "8", "-", "8", "8", "16"]
    assert rows[1][:7] == ["capped", "disk", "8", "-", "-", "8", "0"]


def test_a_token_sees_only_its_namespaces(capped, connect):
    d, _ = capped
    conns = {token: connect(d.target, token=token) for token in (CAPPED, BYSTANDER, ADMIN)}
    conns[CAPPED].session("capped").put(keys("seen-capped", 1))
    conns[BYSTANDER].session("bystander").put(keys("seen-bystander", 1))

    def names(token: str) -> set[str]:
        return {n.namespace for p in conns[token].state().pools for n in p.namespaces}

    assert names(CAPPED) == {"capped"}
    assert names(BYSTANDER) == {"bystander"}
    assert names(ADMIN) >= {"capped", "bystander"}
    out = run_kvtier("stats", "--socket", str(d.socket), "--json", env={"KVTIER_TOKEN": BYSTANDER})
    assert out.returncode == 0 and '"capped"' not in out.stdout and '"bystander"' in out.stdout

    # Explain by namespace needs a token that grants it, like Register.
    request = pb.ExplainRequest(namespace="bystander", keys=keys("seen-bystander", 1))
    expect_code(grpc.StatusCode.PERMISSION_DENIED, conns[CAPPED].call, "Explain", request)
    assert conns[BYSTANDER].call("Explain", request).blocks[0].state == pb.BLOCK_CACHED
    refused = run_kvtier("stats", "why", "--socket", str(d.socket), "--namespace", "bystander", "00" * 16,
                         env={"KVTIER_TOKEN": CAPPED})
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr
