"""Pages hashed once, by the client that writes them (issue 25).

`WriteLease.write` copies a page and hashes it on the way; `commit` sends each page's
xxh3-64 and the daemon enters it in its slot table without reading the page again. The
daemon never trusts a checksum with anyone else's bytes: every later reader checks the
bytes against it, so a page whose checksum went stale (written again through its view
after `write`) is dropped at the next check, never served, and only that page goes.
Real daemons, a real arena keeper, kill -9.
"""
from __future__ import annotations

import dataclasses
import signal
import uuid

import grpc
import numpy as np
import pytest
import xxhash
from kvtier_client import KVTierClient, frames
from kvtier_client.errors import NotFound
from kvtier_client.frames import FrameError
from kvtier_client.layout import PageLayout
from kvtier_client.proto.v1 import kvtier_pb2 as pb

LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=64, block_tokens=16, dtype="float16")  # 4 KiB pages


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 255, LAYOUT.page_bytes, dtype=np.uint8)


def key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def _start(daemons, prefix: str, host_size: str = "1MiB", disk_size: str = "4MiB"):
    daemon = daemons.start("--arena-prefix", prefix, name="d", host_size=host_size, disk_size=disk_size)
    daemon.arena_prefix = prefix  # so that teardown removes what a kill leaves
    return daemon


def _read(client: KVTierClient, k: bytes) -> bytes | None:
    if not client.lookup([k]).hit_blocks:
        return None
    with client.acquire([k]) as lease:
        return lease.pages[0].reshape(-1).view(np.uint8).tobytes()


def test_write_copies_the_page_and_records_its_checksum(daemons):
    daemon = _start(daemons, f"kvtier-test-sums-{uuid.uuid4().hex[:6]}")
    with KVTierClient(daemon.target) as client:
        client.register("ns", LAYOUT)
        lease = client.borrow(2)
        lease.write(0, payload(0))
        assert lease.checksums == {0: xxhash.xxh3_64_intdigest(payload(0))}
        with pytest.raises(ValueError, match="holds 4096 bytes; got 4095"):
            lease.write(1, payload(1)[:-1])
        lease.write(1, payload(1))
        assert lease.commit([key(0), key(1)]).committed == 2
        assert _read(client, key(0)) == payload(0).tobytes() and _read(client, key(1)) == payload(1).tobytes()


def test_a_stale_checksum_loses_only_its_page_at_a_warm_restart(daemons):
    prefix = f"kvtier-test-sums-{uuid.uuid4().hex[:6]}"
    first = _start(daemons, prefix)
    with KVTierClient(first.target) as client:
        client.register("ns", LAYOUT)
        lease = client.borrow(3)
        for i in range(3):
            lease.write(i, payload(i))
        lease.pages[1].reshape(-1).view(np.uint8)[:] = payload(99)  # after write(): its checksum is stale
        lease.commit([key(0), key(1), key(2)])
        with client.borrow(1) as other:  # pages the client does not hash with write(): commit hashes them
            other.pages[0].reshape(-1).view(np.uint8)[:] = payload(3)
            other.commit([key(3)])
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL

    second = _start(daemons, prefix)
    assert "3 pages found again, 1 dropped" in second.log()
    with KVTierClient(second.target) as client:
        client.register("ns", LAYOUT)
        assert _read(client, key(1)) is None  # dropped, never served with bytes its checksum does not match
        for i in (0, 2, 3):
            assert _read(client, key(i)) == payload(i).tobytes()


def test_a_stale_checksum_is_caught_when_the_page_comes_back_from_disk(daemons):
    daemon = _start(daemons, f"kvtier-test-sums-{uuid.uuid4().hex[:6]}", host_size="64KiB", disk_size="1MiB")
    host_pages = 16
    with KVTierClient(daemon.target) as client:
        client.register("ns", LAYOUT)
        lease = client.borrow(2)
        lease.write(0, payload(0))
        lease.write(1, payload(1))
        lease.pages[1].reshape(-1).view(np.uint8)[:] = payload(99)
        lease.commit([key(0), key(1)])
        for i in range(10, 10 + 2 * host_pages, 4):  # push both down to disk
            with client.borrow(4) as more:
                for j in range(4):
                    more.write(j, payload(i + j))
                more.commit([key(i + j) for j in range(4)])
        assert client.lookup([key(0)]).tiers[0].label == "disk"
        assert _read(client, key(0)) == payload(0).tobytes()  # written to disk with its checksum, verified
        assert client.lookup([key(1)]).tiers[0].label == "disk"
        with pytest.raises(NotFound, match="could not be loaded"):  # its read fails the check: dropped
            client.acquire([key(1)])
        assert _read(client, key(1)) is None


def test_the_daemon_refuses_a_checksum_count_that_does_not_match_the_keys(daemons, connect):
    daemon = _start(daemons, f"kvtier-test-sums-{uuid.uuid4().hex[:6]}")
    s = connect(daemon.target).session("ns")
    lease = s.borrow(2)
    with pytest.raises(grpc.RpcError) as refused:
        s.call("Commit", pb.CommitRequest(session_id=s.id, lease_id=lease.lease_id, keys=[key(0), key(1)],
                                          checksums=[1]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1 checksums for 2 keys" in refused.value.details()


def test_commit_frames_carry_checksums_only_with_their_flag():
    keys_ = [b"a" * 8, b"b" * 8]
    op, flags, seq, body = frames.split(frames.commit(7, 42, keys_, b"p", None, [1, 2**64 - 1]))
    assert (op, flags, seq) == (frames.Op.COMMIT, frames.CHECKSUMS, 7)
    lease_id, parent, got, token_ids, checksums = frames.read_commit_checksums(flags, body)
    assert (lease_id, parent, got, token_ids, list(checksums)) == (42, b"p", keys_, None, [1, 2**64 - 1])
    assert frames.read_commit(flags, body) == (42, b"p", keys_, None)  # a reader that wants no checksums
    with pytest.raises(FrameError, match="checksums are cut short"):
        frames.read_commit_checksums(flags, body[:-1])
    with pytest.raises(FrameError, match="bytes after the end"):
        frames.read_commit_checksums(0, body)  # checksums without the flag


def test_a_client_sends_checksums_only_to_a_daemon_that_takes_them(daemons, monkeypatch):
    """The daemon says so at Register (commit_checksums); a client of a daemon that does not
    (one from before them) commits as before and the daemon hashes the pages."""
    sent: list = []
    real = frames.commit

    def spy(*args, **kwargs):
        sent.append(args[5] if len(args) > 5 else kwargs.get("checksums"))
        return real(*args, **kwargs)

    monkeypatch.setattr(frames, "commit", spy)
    daemon = _start(daemons, f"kvtier-test-sums-{uuid.uuid4().hex[:6]}")
    with KVTierClient(daemon.target) as client:
        info = client.register("ns", LAYOUT)
        assert info.commit_checksums
        lease = client.borrow(1)
        lease.write(0, payload(0))
        lease.commit([key(0)])
        assert list(sent.pop()) == [xxhash.xxh3_64_intdigest(payload(0))]
        session = client._current()
        session.info = dataclasses.replace(session.info, commit_checksums=False)  # as an older daemon answers
        lease = client.borrow(1)
        lease.write(0, payload(1))
        lease.commit([key(1)])
        assert sent.pop() is None
        assert _read(client, key(1)) == payload(1).tobytes()
