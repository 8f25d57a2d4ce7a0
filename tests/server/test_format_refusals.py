"""A downgrade: `kvtier serve` finds a disk tier or a kept host tier that a newer kvtier
wrote (kvtier.mechanism.formats). It exits 2 with one line saying what it found, what it
reads and what to do, and leaves what it found as it was: the newer kvtier, started again,
still has its pages. Real daemons, a real arena keeper, the real files.
"""
from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import lmdb
from daemon import KVTIER
from rpc import Arena, keys, page, run_kvtier
from test_serve import assert_refused


def _commit(daemon, connect, blocks: list[bytes]) -> None:
    s = connect(daemon.target).session("fmt")
    arena = Arena.of(s)
    lease = s.borrow(len(blocks))
    for slot, key in zip(lease.slots, blocks):
        arena.write(slot, page(key.hex()))
    s.commit(lease.lease_id, blocks)
    arena.close()


def _found(daemon, connect, blocks: list[bytes]) -> int:
    s = connect(daemon.target).session("fmt")
    return s.lookup(blocks).hit_blocks


def _set_index_format(cache_dir: Path, value: bytes) -> Path:
    """Set the `format` meta entry of the one layout's disk index; returns its directory."""
    [directory] = [p for p in cache_dir.iterdir() if (p / "index.lmdb").is_dir()]
    env = lmdb.open(str(directory / "index.lmdb"), max_dbs=2)
    try:
        with env.begin(write=True, db=env.open_db(b"meta")) as txn:
            txn.put(b"format", value)
    finally:
        env.close()
    return directory


def test_a_disk_tier_of_a_newer_kvtier_is_refused_at_start(daemons, connect):
    first = daemons.start("--warm-restart-window", "0", name="d")
    blocks = keys("disk", 8)
    _commit(first, connect, blocks)
    assert first.stop() == 0  # a clean stop copies the host pages to disk
    directory = _set_index_format(first.cache_dir, b"4")  # as a newer kvtier leaves it

    line = assert_refused(run_kvtier(*first.args[len(KVTIER):]), "upgrade kvtier")
    assert line == (f"kvtier serve: disk tier at {directory} holds disk index format 4, written by a newer kvtier; "
                    "this kvtier reads disk index formats up to 3: upgrade kvtier, or move that directory away (or "
                    "start with an empty --cache-dir) for an empty disk tier")

    _set_index_format(first.cache_dir, b"3")  # the newer kvtier's pages are all still there
    again = daemons.start("--warm-restart-window", "0", name="d")
    assert _found(again, connect, blocks) == len(blocks)


def _keeper_table(prefix: str) -> str:
    """/proc path of the slot table memfd the arena keeper holds for the arena `prefix`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(f"/memfd:{prefix}-") and "-slots" in target:
                    return f"/proc/{pid}/fd/{fd}"
        except OSError:
            continue  # a process that ended, or not ours
    raise AssertionError(f"no arena keeper holds a slot table of {prefix}")


def _set_magic(path: str, magic: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, magic, 0)
    finally:
        os.close(fd)


def test_a_kept_host_tier_of_a_newer_kvtier_is_refused_at_start(daemons, connect):
    prefix = f"kvtier-test-fmt-{uuid.uuid4().hex[:6]}"
    first = daemons.start("--arena-prefix", prefix, name="d")
    first.arena_prefix = prefix
    blocks = keys("host", 8)
    _commit(first, connect, blocks)
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL  # the keeper holds the host tier
    table = _keeper_table(prefix)
    _set_magic(table, b"kvtier-slots-v2\0")  # as a newer kvtier's table reads

    # Its info lines (a stale socket replaced, the keeper found) go before it; warnings and the refusal only here.
    restart = run_kvtier(*first.args[len(KVTIER):], "--log-level", "warning")
    line = assert_refused(restart, "slot table format 2", "upgrade kvtier")
    assert "this kvtier reads slot table formats up to 1" in line and "--warm-restart-window 0" in line

    _set_magic(table, b"kvtier-slots-v1\0")  # the newer kvtier back: its host pages are still kept
    again = daemons.start("--arena-prefix", prefix, name="d")
    again.arena_prefix = prefix
    assert _found(again, connect, blocks) == len(blocks)
    assert "adopted host arena" in again.log()
