"""The engine's round trip against a real daemon: keys, lookup, borrow/commit, acquire/release,
bytes through the shared-memory views, leases ending, typed errors, capacity, close."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from client_helpers import LAYOUT, as_bytes, kv_pages, tokens
from kvtier_client import (
    CapacityError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PageLayout,
    Tier,
    Wait,
    block_keys,
)


def write_blocks(client, keys, data, parent=None):
    """Borrow, fill page i with data[i] through the shared-memory view, commit under keys."""
    with client.borrow(len(keys)) as lease:
        for page, payload in zip(lease.pages, data):
            as_bytes(page)[:] = payload
        return lease.commit(keys, parent=parent)


def test_round_trip_through_shared_memory(daemon, clients, namespace):
    client = clients(daemon.target, name="engine-a")
    pool = client.register(namespace, LAYOUT)
    assert pool.page_bytes == LAYOUT.page_bytes and pool.slot_bytes >= pool.page_bytes
    assert pool.capacity(Tier.HOST) > 0 and pool.capacity(Tier.DISK) > 0

    # Keys follow the registered layout's block size and algorithm: 70 tokens -> 4 blocks.
    prompt = tokens(70)
    keys = client.block_keys(prompt)
    assert keys == block_keys(prompt, LAYOUT.block_tokens, algorithm=pool.algorithm)
    assert len(keys) == 4

    # A miss, then the engine writes its KV in place and commits it.
    assert client.lookup(keys).hit_blocks == 0
    data = kv_pages(4, LAYOUT, seed=1)
    result = write_blocks(client, keys, data)
    assert (result.committed, result.duplicates) == (4, ())

    # A hit in host memory; acquire hands back the very bytes that were written.
    hit = client.lookup(keys)
    assert hit.hit_blocks == 4 and hit.tiers == (Tier.HOST,) * 4
    with client.acquire(hit.hit_keys(keys)) as lease:
        assert lease.ready == 4 and len(lease.pages) == 4
        for page, payload in zip(lease.pages, data):
            assert page.shape == LAYOUT.shape and page.dtype == np.float16
            assert not page.flags.writeable
            np.testing.assert_array_equal(as_bytes(page), payload)
    assert lease.ended

    stats = client.stats()
    pool_stats = stats.pool(pool.pool_id)
    host = pool_stats.tier(Tier.HOST)
    assert host.cached_pages >= 4 and host.pinned_pages == 0 and host.writing_pages == 0
    assert host.capacity_pages == pool.capacity(Tier.HOST)
    assert stats.leases == 0


def test_another_process_reads_the_pages(daemon, clients, namespace):
    """A second engine process (its own mapping of the arena) reads what this one wrote."""
    writer = clients(daemon.target)
    writer.register(namespace, LAYOUT)
    keys = writer.block_keys(tokens(48, seed=2))
    data = kv_pages(len(keys), LAYOUT, seed=2)
    write_blocks(writer, keys, data)

    script = textwrap.dedent(
        f"""
        import hashlib, json, sys
        from kvtier_client import KVTierClient, PageLayout
        layout = PageLayout(**{LAYOUT.__dict__!r})
        keys = [bytes.fromhex(k) for k in {[k.hex() for k in keys]!r}]
        with KVTierClient({daemon.target!r}, name="reader") as client:
            client.register({namespace!r}, layout)
            hit = client.lookup(keys)
            with client.acquire(hit.hit_keys(keys)) as lease:
                digests = [hashlib.sha256(p.tobytes()).hexdigest() for p in lease.pages]
        print(json.dumps({{"hit": hit.hit_blocks, "digests": digests}}))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["hit"] == len(keys)
    assert reply["digests"] == [hashlib.sha256(d.tobytes()).hexdigest() for d in data]


def test_torch_views_round_trip(daemon, clients, namespace):
    torch = pytest.importorskip("torch")
    layout = PageLayout(layers=2, kv_heads=2, head_dim=32, block_tokens=16, dtype="bfloat16")
    writer, reader = clients(daemon.target), clients(daemon.target)
    writer.register(namespace, layout)
    reader.register(namespace, layout)
    keys = writer.block_keys(tokens(32, seed=3))
    kv = torch.randn(len(keys), *layout.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)

    with writer.borrow(len(keys)) as lease:
        for tensor, values in zip(lease.tensors(), kv):
            assert tensor.dtype == torch.bfloat16 and tuple(tensor.shape) == layout.shape
            tensor.copy_(values)
        lease.commit(keys)

    with reader.acquire(keys) as lease:
        for tensor, values in zip(lease.tensors(), kv):
            assert torch.equal(tensor, values)
        # numpy shows the same pages as raw bfloat16 bits.
        for page, values in zip(lease.pages, kv):
            assert page.dtype == np.uint16
            np.testing.assert_array_equal(page, values.view(torch.int16).numpy().view(np.uint16))


def test_prefix_continuation_with_parent(daemon, clients, namespace):
    """A second turn extends the cached prefix: keys chained from the last cached key."""
    client = clients(daemon.target)
    client.register(namespace, LAYOUT)
    turn1 = tokens(32, seed=4)
    turn2 = turn1 + tokens(32, seed=5)
    keys1 = client.block_keys(turn1)
    write_blocks(client, keys1, kv_pages(2, LAYOUT, seed=4))

    keys2 = client.block_keys(turn2)
    hit = client.lookup(keys2)
    assert hit.hit_blocks == 2 and keys2[:2] == keys1
    tail = client.block_keys(turn2[32:], parent=keys2[1])
    assert tail == keys2[2:]
    write_blocks(client, tail, kv_pages(2, LAYOUT, seed=5), parent=keys2[1])
    assert client.lookup(keys2).hit_blocks == 4


def test_leaving_borrow_without_commit_frees_pages(daemon, clients, namespace):
    client = clients(daemon.target)
    pool = client.register(namespace, LAYOUT)

    def host():
        return client.stats().pool(pool.pool_id).tier(Tier.HOST)

    free_before = host().free_pages
    with client.borrow(3) as lease:
        assert host().writing_pages == 3
    assert lease.ended
    assert host().writing_pages == 0 and host().free_pages == free_before

    with pytest.raises(RuntimeError, match="engine failed"):
        with client.borrow(2):
            raise RuntimeError("engine failed")
    assert host().writing_pages == 0 and client.stats().leases == 0


def test_duplicate_commit_keeps_the_cached_page(daemon, clients, namespace):
    client = clients(daemon.target)
    client.register(namespace, LAYOUT)
    keys = client.block_keys(tokens(32, seed=6))
    first = kv_pages(2, LAYOUT, seed=6)
    write_blocks(client, keys, first)
    again = write_blocks(client, keys, kv_pages(2, LAYOUT, seed=7))
    assert (again.committed, again.duplicates) == (0, (0, 1))
    with client.acquire(keys) as lease:
        for page, payload in zip(lease.pages, first):
            np.testing.assert_array_equal(as_bytes(page), payload)


def test_namespaces_do_not_share_keys(daemon, clients, namespace):
    a, b = clients(daemon.target), clients(daemon.target)
    a.register(namespace + "/a", LAYOUT)
    b.register(namespace + "/b", LAYOUT)
    keys = a.block_keys(tokens(32, seed=8))
    write_blocks(a, keys, kv_pages(2, LAYOUT, seed=8))
    assert a.lookup(keys).hit_blocks == 2
    assert b.lookup(keys).hit_blocks == 0
    with pytest.raises(NotFound):
        b.acquire(keys)


def test_daemon_errors_arrive_typed(daemon, clients, namespace):
    client = clients(daemon.target)
    client.register(namespace, LAYOUT)
    keys = client.block_keys(tokens(32, seed=9))

    with pytest.raises(NotFound, match="not cached"):
        client.acquire(keys)
    assert client.reconnects == 0  # a missing key is not mistaken for a lost session

    with pytest.raises(InvalidArgument):
        client.borrow(0)

    write_blocks(client, keys, kv_pages(2, LAYOUT, seed=9))
    read = client.acquire(keys)
    with pytest.raises(FailedPrecondition):
        client.commit(read, keys)  # a read lease cannot be committed
    read.release()
    with pytest.raises(FailedPrecondition):
        read.release()  # double release
    assert client.stats().leases == 0


def test_capacity_exhaustion_is_typed_and_changes_nothing(daemon, clients, namespace):
    # 8 layers x 2 x 64 tokens x 4 heads x 64 dim x 2 bytes = 1 MiB pages: 16 in the 16 MiB host tier.
    layout = PageLayout(layers=8, kv_heads=4, head_dim=64, block_tokens=64, dtype="float16")
    client = clients(daemon.target)
    pool = client.register(namespace, layout)
    pages = pool.capacity(Tier.HOST)
    with client.borrow(pages):
        with pytest.raises(CapacityError, match="full"):
            client.borrow(1)
        host = client.stats().pool(pool.pool_id).tier(Tier.HOST)
        assert host.writing_pages == pages and host.free_pages == 0
    with client.borrow(1) as lease:  # room again once the first lease is gone
        assert lease.count == 1


def test_acquire_wait_options(daemon, clients, namespace):
    client = clients(daemon.target)
    client.register(namespace, LAYOUT)
    keys = client.block_keys(tokens(48, seed=10))
    write_blocks(client, keys, kv_pages(3, LAYOUT, seed=10))
    with client.acquire(keys, wait=Wait.NONE) as lease:
        assert lease.ready == 3 and len(lease.pages) == 3  # host pages are ready at once
    with client.acquire(keys, deadline=0.5) as lease:
        assert lease.ready == 3
    with pytest.raises(ValueError, match="deadline"):
        client.acquire(keys, wait=Wait.DEADLINE)


def test_close_ends_the_session_and_its_leases(daemon, clients, namespace):
    watcher = clients(daemon.target)
    client = clients(daemon.target)
    client.register(namespace, LAYOUT)
    sessions = watcher.stats().sessions
    client.borrow(2)  # left open on purpose
    assert watcher.stats().leases >= 1
    client.close()
    after = watcher.stats()
    assert after.sessions == sessions - 1
    assert after.leases == 0
    client.close()  # idempotent
    with pytest.raises(FailedPrecondition, match="closed"):
        client.lookup([b"k" * 16])


def test_prefetch_hint(daemon, clients, namespace):
    client = clients(daemon.target)
    client.register(namespace, LAYOUT)
    keys = client.block_keys(tokens(32, seed=12))
    write_blocks(client, keys, kv_pages(2, LAYOUT, seed=12))
    assert client.prefetch(keys, priority=1) == len(keys)
    says = "prefetch loads pages into host, not device; an acquire into device promotes them from there"
    with pytest.raises(ValueError, match=says) as refused:  # the client's check, before sending
        client.prefetch(keys, tier=Tier.DEVICE)
    assert not isinstance(refused.value, InvalidArgument)
    # The daemon applies the same rule to a request that skipped it, on either transport.
    with pytest.raises(InvalidArgument, match=says):
        client._in_session(lambda s: s.path.prefetch(keys, Tier.DEVICE, 0, 0.0))


def test_calls_before_register_say_so(daemon, clients):
    client = clients(daemon.target)
    with pytest.raises(FailedPrecondition, match="register"):
        client.lookup([b"k" * 16])
    client.register("test/once", LAYOUT)
    with pytest.raises(FailedPrecondition, match="already registered"):
        client.register("test/twice", LAYOUT)
