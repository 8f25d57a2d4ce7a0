"""Cache control through KVTierClient against real daemons (docs/cache-control.md): every
action over the fast lane and over gRPC, a soft pin through a flood, hard pins within and
past the namespace's guarantee, a hard pin bringing a disk-only prefix into host, hints
that end with the client or outlive it, and a namespace that cannot touch another's keys."""
from __future__ import annotations

import socket
import textwrap
import time

import pytest
from client_helpers import LAYOUT, tokens
from kvtier_client import (
    CapacityError, FailedPrecondition, KVTierClient, PinMode, Priority, SteerResult, Tier,
)
from kvtier_client.results import BlockReason

A, B, ADMIN = "token-steer-a-1f3e5d7c9b", "token-steer-b-2e4d6c8a0f", "token-steer-admin-3d5c7b9a1e"
GUARANTEE = 4  # namespace a's guaranteed_host_pages: the most it may hard-pin


@pytest.fixture(scope="module")
def steer_daemon(tmp_path_factory):
    """A daemon with a host tier of 32 pages (8 KiB each) over a disk, and tokens: a and b
    each their own namespace, a with a guarantee of 4 host pages."""
    from daemon import start_daemon, stop_all

    base = tmp_path_factory.mktemp("steer")
    path = base / "tokens.toml"
    path.write_text(textwrap.dedent(f"""
        [tokens]
        "{A}" = ["a"]
        "{B}" = ["b"]
        "{ADMIN}" = ["*"]
        [namespaces.a]
        guaranteed_host_pages = {GUARANTEE}
    """))
    with socket.socket() as probe:  # a free port for the TCP listener (remote clients)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = start_daemon(base, "--tokens-file", str(path), "--tcp", f"127.0.0.1:{port}", "--insecure",
                     host_size="256KiB", disk_size="2MiB")
    d.tcp = f"127.0.0.1:{port}"
    try:
        yield d
    finally:
        problems = stop_all([d])
        assert not problems, "\n".join(problems)


def client(daemon, token: str, namespace: str, *, lane: bool = True) -> KVTierClient:
    kv = KVTierClient(daemon.target, token=token, lane=lane, timeout=10.0)
    kv.register(namespace, LAYOUT)
    return kv


def put(kv: KVTierClient, seed: int, blocks: int) -> list[bytes]:
    """Commit `blocks` fresh blocks of one prompt; returns their keys."""
    keys = kv.block_keys(tokens(blocks * LAYOUT.block_tokens, seed))
    with kv.borrow(len(keys)) as lease:
        lease.commit(keys)
    return keys


def hints(kv: KVTierClient, keys: list[bytes]) -> list[str]:
    return [b.hint for b in kv.explain(keys).blocks]


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "grpc"])
def test_every_action_over_either_transport(steer_daemon, lane):
    with client(steer_daemon, B, "b", lane=lane) as kv:
        assert kv.transport == ("lane" if lane else "grpc")
        keys = put(kv, 100 + lane, 4)
        unknown = b"\x01" * 16
        assert kv.pin(keys + [unknown, keys[0]], ttl=60) == SteerResult(4, 1, 0, "1 keys not cached here")
        assert all(h.startswith("soft pin by session") and "for 60 s" in h for h in hints(kv, keys))
        assert kv.retain(keys[:2], Priority.HIGH).applied == 2
        assert kv.retain(keys[2:], Priority.COLD, ttl=30).applied == 2
        found = hints(kv, keys)
        assert found[0].startswith("retain high") and found[3].startswith("retain cold"), found
        assert kv.unpin(keys) == SteerResult(4, 0, 0, "")
        assert hints(kv, keys) == [""] * 4

        assert kv.demote(keys[:2]) == SteerResult(2, 0, 0, "")  # to disk: written, then off host
        assert kv.lookup(keys).tiers == (Tier.DISK, Tier.DISK, Tier.HOST, Tier.HOST)
        assert kv.demote(keys[2:], tier=Tier.HOST).applied == 2  # no device here: already below it
        assert kv.drop(keys[3:] + [unknown]) == SteerResult(1, 1, 0, "")
        assert kv.lookup(keys).hit_blocks == 3
        gone = kv.explain(keys).blocks[3]
        assert gone.reason is BlockReason.DROPPED and gone.policy == ""

        with pytest.raises(ValueError, match="ttl must be"):  # refused before sending
            kv.pin(keys, ttl=-1)
        with pytest.raises(ValueError, match="host or disk"):
            kv.demote(keys, tier=Tier.CLUSTER)


def test_a_soft_pinned_prefix_survives_a_flood_of_other_puts(steer_daemon):
    with client(steer_daemon, B, "b") as kv, client(steer_daemon, ADMIN, "flood") as flood:
        prefix = put(kv, 200, 4)
        assert kv.pin(prefix, ttl=60).applied == 4
        other = put(kv, 201, 4)  # unpinned, as old as the prefix
        for seed in range(300, 340):  # 160 pages through a 32-page host tier
            put(flood if seed % 2 else kv, seed, 4)
        assert kv.lookup(prefix).tiers == (Tier.HOST,) * 4
        assert Tier.HOST not in kv.lookup(other).tiers  # the unpinned blocks went down
        kv.unpin(prefix)


def test_a_hard_pin_is_charged_to_the_guarantee(steer_daemon):
    with client(steer_daemon, A, "a") as kv, client(steer_daemon, B, "b") as other:
        with pytest.raises(FailedPrecondition, match="no guaranteed host pages"):
            other.pin(put(other, 400, 1), mode=PinMode.HARD)  # b has no guarantee
        keys = put(kv, 401, GUARANTEE + 2)
        assert kv.pin(keys[:GUARANTEE], mode=PinMode.HARD, ttl=60).applied == GUARANTEE
        with pytest.raises(CapacityError, match=f"past its {GUARANTEE} guaranteed host pages"):
            kv.pin(keys[GUARANTEE:], mode=PinMode.HARD)
        assert hints(kv, keys)[GUARANTEE:] == ["", ""]  # refused: nothing changed
        assert kv.pin(keys[:GUARANTEE], mode=PinMode.HARD).applied == GUARANTEE  # re-pinning costs nothing more
        # A hard-pinned block stays in host: demote skips it and says why.
        result = kv.demote(keys[:2])
        assert (result.applied, result.skipped) == (0, 2) and "hard-pinned" in result.note
        assert kv.unpin(keys).applied == GUARANTEE


def test_a_hard_pin_brings_a_disk_only_prefix_into_host(steer_daemon):
    with client(steer_daemon, A, "a") as kv:
        keys = put(kv, 500, 3)
        assert kv.demote(keys).applied == 3
        assert kv.lookup(keys).tiers == (Tier.DISK,) * 3
        assert kv.pin(keys, mode=PinMode.HARD).applied == 3
        deadline = time.monotonic() + 10
        while kv.lookup(keys).tiers != (Tier.HOST,) * 3:
            assert time.monotonic() < deadline, kv.lookup(keys)
            time.sleep(0.02)
        assert kv.unpin(keys).applied == 3


def test_hints_without_a_ttl_end_with_the_client_and_hints_with_one_outlive_it(steer_daemon):
    with client(steer_daemon, B, "b") as kv:
        session_bound, timed = put(kv, 600, 2), put(kv, 601, 2)
        kv.pin(session_bound)
        kv.retain(timed, Priority.HIGH, ttl=120)
    with client(steer_daemon, B, "b") as later:
        found = hints(later, session_bound + timed)
        assert found[:2] == ["", ""], found
        assert all(h.startswith("retain high") and "left)" in h for h in found[2:]), found
        later.unpin(timed)


def test_another_namespace_can_neither_see_nor_touch_the_keys(steer_daemon):
    with client(steer_daemon, A, "a") as owner, client(steer_daemon, B, "b") as stranger:
        keys = put(owner, 700, 3)
        for call in (lambda ks: stranger.pin(ks, ttl=60), lambda ks: stranger.retain(ks, Priority.COLD),
                     stranger.unpin, stranger.demote, stranger.drop):
            result = call(keys)
            assert (result.applied, result.missing) == (0, 3), result
        assert owner.lookup(keys).tiers == (Tier.HOST,) * 3 and hints(owner, keys) == ["", "", ""]


def test_a_remote_client_steers_over_grpc(steer_daemon):
    """A client on another host (TCP, nothing mapped) has no lane: its hints go over gRPC."""
    with client(steer_daemon, B, "b") as local:
        keys = put(local, 800, 2)
        with KVTierClient(steer_daemon.tcp, token=B, insecure=True, map_arena=False, timeout=10.0) as remote:
            remote.register("b", LAYOUT)
            assert remote.transport == "grpc"
            assert remote.pin(keys, ttl=60) == SteerResult(2, 0, 0, "")
            assert remote.drop(keys[1:]).applied == 1
        assert hints(local, keys[:1])[0].startswith("soft pin by session")
        assert local.lookup(keys).hit_blocks == 1


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "grpc"])
def test_a_prefetch_deadline_holds_a_prefix_in_host_through_a_flood(steer_daemon, lane):
    """Pages held for a prefetch's deadline go only as a last resort: a flood of 80 blocks
    through a 32-page host keeps them, and evicts a prefix prefetched without a deadline
    (already in host, so nothing to load and nothing held)."""
    with client(steer_daemon, B, "b", lane=lane) as kv:
        held, plain = put(kv, 900 + lane, 3), put(kv, 910 + lane, 3)  # seeds no other test uses
        assert kv.prefetch(held, hold=60) == 3 and kv.prefetch(plain) == 3
        for seed in range(20):
            put(kv, 1000 + 20 * lane + seed, 4)
        assert kv.lookup(held).tiers == (Tier.HOST,) * 3
        assert Tier.HOST not in kv.lookup(plain).tiers
        with pytest.raises(ValueError, match="hold"):  # refused before sending
            kv.prefetch(held, hold=601)
