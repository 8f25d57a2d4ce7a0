"""A disk tier on a filesystem that runs out of space degrades that tier, never the daemon.

The fault is real: a small tmpfs mounted for the test holds the cache directory. A
preallocated slab never gets ENOSPC from `pwrite` (its blocks are reserved), but the LMDB
index grows and does. To make the slab writes fail too, the test punches holes into the
slab (as a sparse copy or a thin-provisioned volume would leave it) and then fills the
filesystem with a filler file: every slab write and index growth then fails with ENOSPC.
Removing the filler heals it. Needs root (mount); skipped otherwise.
"""
from __future__ import annotations

import ctypes
import errno
import os
import subprocess
from pathlib import Path

import pytest
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.tiers import Tier
from rpc import Arena, keys, page

from kvtier.core.invariants import check_invariants

FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
DEGRADED = "writes degrade the disk tier"
RECOVERED = "writes work again after"


class SmallFs:
    """A tmpfs of a few MiB at `path` that the test can fill up and free again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.filler = path / "filler"

    def break_(self) -> None:
        """Punch holes over every slab under the mount, then fill the filesystem."""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        for slab in self.path.rglob("slab.bin"):
            fd = os.open(slab, os.O_RDWR)
            try:
                if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, os.fstat(fd).st_size):
                    raise OSError(ctypes.get_errno(), f"punching holes into {slab}")
            finally:
                os.close(fd)
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while True:
                os.write(fd, bytes(4096))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        finally:
            os.close(fd)

    def heal(self) -> None:
        self.filler.unlink()


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 4 MiB tmpfs at tmp_path/d/cache: the cache dir of `daemons.start(name="d")`.
    Request it before `daemons`, so the daemon stops before the unmount."""
    path = tmp_path / "d" / "cache"
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for the fault ({done.stderr.strip()}): needs root or CAP_SYS_ADMIN")
    try:
        yield SmallFs(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_core_frees_what_a_failed_write_took(small_fs, make_pool):
    """In process: a failed demotion leaves no disk slot allocated and no LMDB entry behind,
    counts the pages in the disk's io_errors, and later writes work again."""
    pool = make_pool(host_pages=8, disk_pages=32, disk_dir=str(small_fs.path))
    store, ns = pool.store, "ns"

    def put(tag: str, n: int = 8) -> list[bytes]:
        ks = keys(tag, n)
        lease = store.borrow("s", ns, n)
        store.commit("s", lease.lease_id, ks)
        check_invariants(store, pool.disk.records())
        return ks

    put("a")
    put("b")  # a -> disk
    disk = store.stats().tier(Tier.DISK)
    assert (disk.cached, disk.counters.io_errors) == (8, 0)
    small_fs.break_()
    lost = put("c")  # b cannot go to disk: dropped
    put("d")  # c too; the disk pages of a (punched, on a full fs) stay filed
    disk = store.stats().tier(Tier.DISK)
    assert disk.counters.io_errors == 16 and disk.cached + disk.free == disk.capacity
    assert store.lookup(ns, lost).hit_blocks == 0
    assert pool.disk.io_errors == 2
    small_fs.heal()
    put("e")  # d -> disk
    assert store.stats().tier(Tier.DISK).cached == 16
    assert store.lookup(ns, keys("d", 8)).hit_blocks == 8


def served(session, arena: Arena, ks: list[bytes]) -> int:
    """Look up `ks`, acquire the hit prefix (waiting for loads; a page that fails to load
    ends the ready prefix) and check every ready page's bytes; returns how many were ready."""
    hit = session.lookup(ks).hit_blocks
    if not hit:
        return 0
    lease = session.acquire(ks[:hit], wait=pb.WAIT_DEADLINE, deadline_ms=10_000)
    for slot, key in zip(lease.slots[: lease.ready], ks):
        assert arena.read(slot) == page(key.hex()), f"wrong bytes served for {key.hex()}"
    session.release(lease.lease_id)
    return lease.ready


def test_daemon_keeps_serving_from_host(small_fs, daemons, connect):
    # 64 host pages, 128 disk pages; every page leaving host is written (with the default
    # admission, pages that never come back stop being written, and so stop failing).
    d = daemons.start("--disk-admission", "all", name="d", host_size="256KiB", disk_size="512KiB")
    s = connect(d.target).session()
    arena = Arena.of(s)

    def put(tag: str, n: int = 64) -> list[bytes]:
        ks = keys(tag, n)
        lease = s.borrow(n)  # fills host: evicts the previous 64 pages
        for slot, key in zip(lease.slots, ks):
            arena.write(slot, page(key.hex()))
        s.commit(lease.lease_id, ks)
        return ks

    put("a")
    put("b")  # a demoted to disk
    small_fs.break_()
    put("c")  # b cannot be written: dropped, no error
    put("d")  # c too
    assert served(s, arena, keys("d", 64)) == 64, "host pages must keep serving"
    assert d.log().count(DEGRADED) == 1, d.log()  # one warning for the episode, not one per call
    small_fs.heal()
    put("e")  # d demoted: the disk works again
    assert RECOVERED in d.log(), d.log()
    small_fs.break_()  # a second episode: disk pages evicted for room, then the write fails
    put("f")
    put("g")
    assert served(s, arena, keys("g", 64)) == 64
    assert d.log().count(DEGRADED) == 2, d.log()
    for tag in "bcef":  # never written: gone
        assert served(s, arena, keys(tag, 64)) == 0, tag
    for tag in "ad":  # on disk, in punched slots: their checksums fail, so they are dropped
        served(s, arena, keys(tag, 64))  # (served() checks the bytes of whatever is served)
    assert d.proc.poll() is None
    assert d.stop() == 0, d.log()  # the stop-time copy to disk fails too: still a clean stop
    assert "Traceback" not in d.log(), d.log()
