"""Tokens and namespaces against a real daemon started with --tokens-file: UNAUTHENTICATED,
PERMISSION_DENIED, and namespaces that never see each other's keys or bytes."""
from __future__ import annotations

import grpc
import pytest
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import Arena, expect_code, keys, page, register_request, run_kvtier, tier_stats, unchanged

Code = grpc.StatusCode
TOKEN_A = "token-a-6c1f0e9b2d7a4f3e8b5c1d0a9f8e7d6c"
TOKEN_B = "token-b-0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a"


@pytest.fixture(scope="module")
def daemon(module_daemons, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = ["tenant-a"]\n"{TOKEN_B}" = ["tenant-b"]\n')
    # 16 host pages, so that filling the host tier is cheap.
    return module_daemons.start("--tokens-file", str(tokens), "--session-timeout", "60s", host_size="64KiB", disk_size="1MiB")


@pytest.fixture
def admin(daemon, connect):
    """A tenant-a connection, used to read Stats."""
    return connect(daemon.target, token=TOKEN_A)


def test_unauthenticated(daemon, admin, connect):
    admin.session("tenant-a")  # a pool exists, so Stats has something to compare
    anonymous = connect(daemon.target)
    impostor = connect(daemon.target, token="token-x-ffffffffffffffffffffffffffffffff")
    with unchanged(admin):
        for conn in (anonymous, impostor):
            message = expect_code(Code.UNAUTHENTICATED, conn.call, "Register", register_request("tenant-a"))
            assert "authorization: Bearer" in message
            expect_code(Code.UNAUTHENTICATED, conn.call, "Stats", pb.StatsRequest())
            # Authentication comes first: an unauthenticated caller learns nothing about the rest.
            expect_code(Code.UNAUTHENTICATED, conn.call, "Register", register_request("tenant-a", fingerprint="00"))
            expect_code(Code.UNAUTHENTICATED, conn.call, "Register", register_request("tenant-a", algorithm="md5", fingerprint="00"))


def test_permission_denied(daemon, admin, connect):
    other = connect(daemon.target, token=TOKEN_B)
    other.session("tenant-b")
    with unchanged(admin):
        for conn, namespace in ((admin, "tenant-b"), (other, "tenant-a"), (admin, "tenant-c")):
            message = expect_code(Code.PERMISSION_DENIED, conn.call, "Register", register_request(namespace))
            assert repr(namespace) in message
        expect_code(Code.PERMISSION_DENIED, admin.call, "Register", register_request("tenant-b", fingerprint="00"))
    assert admin.register("tenant-a").session_id


def test_namespaces_never_share_keys(daemon, connect):
    a = connect(daemon.target, token=TOKEN_A).session("tenant-a")
    b = connect(daemon.target, token=TOKEN_B).session("tenant-b")
    assert a.reply.pool_id == b.reply.pool_id  # same layout, same pool: only the namespace separates them
    shared = keys("same-client-keys", 3)
    a.put(shared)

    # B probes A's keys: a miss, and nothing to acquire.
    assert b.lookup(shared).hit_blocks == 0
    a_read = a.acquire(shared)
    with unchanged(a.conn):
        expect_code(Code.NOT_FOUND, b.acquire, shared)
        expect_code(Code.FAILED_PRECONDITION, b.release, a_read.lease_id)
    a.release(a_read.lease_id)

    # B commits the same client keys: a separate set of blocks.
    before = tier_stats(a.conn.state(), a.reply.pool_id).cached_pages
    reply = b.commit(b.borrow(3).lease_id, shared)
    assert (reply.committed, list(reply.duplicates)) == (3, [])
    assert tier_stats(a.conn.state(), a.reply.pool_id).cached_pages == before + 3
    assert a.lookup(shared).hit_blocks == 3 and b.lookup(shared).hit_blocks == 3


def test_recycled_pages_carry_no_other_namespace_data(daemon, connect):
    a = connect(daemon.target, token=TOKEN_A).session("tenant-a")
    b = connect(daemon.target, token=TOKEN_B).session("tenant-b")
    capacity = a.reply.tiers[0].capacity_pages
    arena = Arena.of(a)
    try:
        lease = a.borrow(capacity)  # every host page: A writes its data into all of them
        for slot in lease.slots:
            arena.write(slot, page(f"secret-{slot}"))
        a.commit(lease.lease_id, keys("a-secrets", capacity))
        # B's borrow evicts (demotes) A's pages and gets their slots.
        mine = b.borrow(capacity)
        assert sorted(mine.slots) == sorted(lease.slots)
        for slot in mine.slots:
            assert arena.read(slot) == bytes(len(arena.read(slot))), f"slot {slot} still holds tenant-a's data"
        b.release(mine.lease_id)
    finally:
        arena.close()


def test_stats_cli_needs_a_token(daemon):
    refused = run_kvtier("stats", "--socket", str(daemon.socket))
    assert refused.returncode != 0
    assert len(refused.stderr.strip().splitlines()) == 1 and "UNAUTHENTICATED" in refused.stderr
    ok = run_kvtier("stats", "--socket", str(daemon.socket), env={"KVTIER_TOKEN": TOKEN_B})
    assert ok.returncode == 0, ok.stderr
    assert "host" in ok.stdout
