"""A page moved between keys in a daemon's disk tier is never served: a real daemon saves
two tenants' pages to disk and stops; the LMDB index in its cache directory is rewritten so
that tenant B's key names tenant A's slot (checksum included, as a later write); the daemon
that starts next finds B's key on disk, but acquiring it is a miss, counted, never A's bytes."""
from __future__ import annotations

import os

import lmdb
import numpy as np
import pytest
from client_helpers import LAYOUT, as_bytes, kv_pages, tokens
from kvtier_client import KVTierClient, NotFound, Tier


def commit(client, seed, blocks=3):
    keys = client.block_keys(tokens(16 * blocks, seed=seed))
    data = kv_pages(blocks, LAYOUT, seed=seed)
    with client.borrow(blocks) as lease:
        for page, payload in zip(lease.pages, data):
            as_bytes(page)[:] = payload
        lease.commit(keys)
    return keys, data


def index_key(namespace: str, key: bytes) -> bytes:
    return len(namespace.encode()).to_bytes(2, "little") + namespace.encode() + key


def test_a_disk_entry_moved_to_another_tenants_key_is_a_miss(daemons, tmp_path):
    first = daemons(path=tmp_path)
    with KVTierClient(first.target) as a, KVTierClient(first.target) as b:
        a.register("tenant-a", LAYOUT)
        b.register("tenant-b", LAYOUT)
        a_keys, _ = commit(a, seed=1)
        b_keys, b_data = commit(b, seed=2)
    assert first.stop() == 0, first.log()  # a clean stop saves host pages to disk

    env = lmdb.open(os.path.join(first.cache_dir, LAYOUT.layout_id, "index.lmdb"), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"pages")) as txn:
        moved = bytearray(txn.get(index_key("tenant-a", a_keys[1])))
        moved[21:29] = (10_000).to_bytes(8, "little")  # a later write sequence (kvtier.mechanism.disk_index)
        txn.put(index_key("tenant-b", b_keys[1]), bytes(moved))
    env.close()

    second = daemons(path=tmp_path)
    with KVTierClient(second.target) as b:
        b.register("tenant-b", LAYOUT)
        assert b.lookup(b_keys).tiers == (Tier.DISK,) * 3  # the index says it is there...
        with pytest.raises(NotFound, match="key 1"):
            b.acquire(b_keys)  # ...but the seal names tenant A's key
        with b.acquire(b_keys[:1]) as lease:
            np.testing.assert_array_equal(as_bytes(lease.pages[0]), b_data[0])
        assert b.lookup(b_keys).hit_blocks == 1
        assert b.stats().pool(b.pool.pool_id).tier(Tier.DISK).corrupt_pages == 1
    assert "dropping misbound page" in second.log()
