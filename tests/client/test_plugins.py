"""A codec, an eviction policy and a cluster backend from outside kvtier, in real daemons:
the plugin package of tests/plugin_package.py, written into tmp_path and put on the
daemons' PYTHONPATH, named by module path (`--policy pkg.mod:MruPolicy`) or by its entry
points, with a client round trip through each (kvtier.registry; docs/policies.md and
docs/tiers.md, "Adding ...")."""
from __future__ import annotations

import numpy as np
from client_helpers import LAYOUT, as_bytes, tokens
from kvtier_client import KVTierClient, Tier
from plugin_package import write_plugin
from test_client_cluster import wait_until, write_blocks

PAGE = LAYOUT.page_bytes


def pages(n: int, seed: int) -> np.ndarray:
    """n distinct pages that zlib shrinks (a short pattern, repeated)."""
    pattern = np.random.default_rng(seed).integers(0, 256, size=(n, 64), dtype=np.uint8)
    return np.tile(pattern, PAGE // 64)


def assert_pages(client: KVTierClient, keys: list[bytes], data: np.ndarray) -> None:
    with client.acquire(keys) as lease:
        assert lease.ready == len(keys)
        for page, payload in zip(lease.pages, data):
            np.testing.assert_array_equal(as_bytes(page), payload)


def test_a_daemon_evicts_by_a_plugin_policy_and_stores_by_a_plugin_codec(daemons, tmp_path):
    plugin = write_plugin(tmp_path / "plugins")
    d = daemons("--policy", plugin.policy, "--codec", plugin.codec, "--disk-admission", "all",
                host_size=str(4 * PAGE), disk_size=str(64 * PAGE), env=plugin.env())
    with KVTierClient(d.target) as kv:
        kv.register("tenant", LAYOUT)
        blocks = [(kv.block_keys(tokens(16, seed=i)), pages(1, seed=i)) for i in range(5)]
        for keys, data in blocks:  # the fifth needs a page of the full host tier: the policy picks which goes
            write_blocks(kv, keys, data)
        tiers = [kv.lookup(keys).tiers for keys, _ in blocks]
        # MRU: the newest page before the fifth went to disk, the oldest stayed (LRU would do the opposite).
        assert tiers[3] == (Tier.DISK,) and tiers[0] == (Tier.HOST,), tiers
        disk = kv.stats().pool(kv.pool.pool_id).tier(Tier.DISK)
        assert 0 < disk.stored_bytes < disk.cached_pages * PAGE // 4  # encoded by the plugin's zlib codec
        for keys, data in blocks:
            assert_pages(kv, keys, data)  # the disk page decoded by it
    d.stop()
    # Restarted from disk with no codec option: the pages name their codec's id, which the
    # daemon finds among the entry points of the kvtier.codecs group.
    d = daemons("--codec", "identity", host_size=str(8 * PAGE), disk_size=str(64 * PAGE), env=plugin.env())
    with KVTierClient(d.target) as kv:
        kv.register("tenant", LAYOUT)
        assert [kv.lookup(keys).tiers for keys, _ in blocks] == [(Tier.DISK,)] * 5
        for keys, data in blocks:
            assert_pages(kv, keys, data)


def test_two_daemons_share_pages_through_a_plugin_cluster_backend(daemons, tmp_path):
    plugin = write_plugin(tmp_path / "plugins")
    store = tmp_path / "shared"
    url = f"{plugin.scheme}://{store}"  # the scheme names the backend: the plugin's entry point
    nodes = []
    for name, extra in (("a", ("--codec", plugin.codec_entry)), ("b", ())):
        (tmp_path / name).mkdir()
        nodes.append(daemons("--cluster", url, *extra, path=tmp_path / name, host_size="1MiB", disk_size="0",
                             env=plugin.env()))
    with KVTierClient(nodes[0].target) as a, KVTierClient(nodes[1].target) as b:
        a.register("tenant", LAYOUT)
        b.register("tenant", LAYOUT)
        keys, data = a.block_keys(tokens(48, seed=7)), pages(3, seed=7)
        write_blocks(a, keys, data)
        wait_until(lambda: b.lookup(keys).hit_blocks == 3, what="node B to see A's pages in the shared store")
        assert b.lookup(keys).tiers == (Tier.CLUSTER,) * 3
        assert_pages(b, keys, data)
        assert b.lookup(keys).tiers == (Tier.HOST,) * 3
    values = [path.read_bytes() for path in store.iterdir()]
    assert len(values) == 3
    for value in values:  # the tier's format, whatever the backend: its header, then the encoded page
        head = value[4: 4 + int.from_bytes(value[:4], "little")]
        assert head[:4] == b"KVTP" and head[6] == plugin.codec_id and len(value) < PAGE // 4
