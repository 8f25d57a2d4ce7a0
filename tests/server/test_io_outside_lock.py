"""No disk I/O under the block store's lock on the request path (issue 14): one client's
disk writes never stall another's host hits.

The store runs on the daemon's real parts, built as a pool builds them: a HostArena (slots
given to namespaces through the core), a DiskTier in a temporary directory, its
DiskReader, their ports (kvtier.mechanism.mover) and the write-back thread. Two properties, checked without
timing:

- every disk write and index deletion (`store`, `forget`) runs on a thread that does not
  hold the store's lock, whichever call caused it: borrow, commit, acquire, release,
  prefetch, the write-back thread;
- while one thread's eviction write is held inside the disk tier, another thread's
  lookup, acquire and release of host pages complete.
"""
from __future__ import annotations

import threading

import pytest
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.core import BlockStore, clean_reserve
from kvtier.core.invariants import check_invariants
from kvtier.mechanism.disk import DiskTier
from kvtier.mechanism.host import HostArena
from kvtier.mechanism.io import DiskReader, WriteBackThread
from kvtier.mechanism.mover import arena_ports

LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16)
WAIT = 10


class GatedDiskTier(DiskTier):
    """A real DiskTier whose batch writes first wait at `gate` (`entered` set when one does)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def write_pages(self, items):
        self.entered.set()
        assert self.gate.wait(WAIT), "the test never opened the gate"
        return super().write_pages(items)


class Rig:
    """A store on real tiers; `calls` records (disk port method, lock held by the caller)."""

    def __init__(self, prefix: str, directory: str, *, host: int, disk: int, write_through: bool,
                 write_back: bool = False) -> None:
        self.host = HostArena(f"{prefix}-io", LAYOUT, host)
        self.disk = GatedDiskTier(directory, LAYOUT, disk, fsync="never")
        self.reader = DiskReader(self.disk, self.host, depth=2)
        self.ports = arena_ports(self.host, self.disk, self.reader)
        self.mover = self.ports.disk
        self.store = BlockStore(LAYOUT, host_pages=host, disk_pages=disk, ports=self.ports,
                                write_through=write_through, prefetch_hold=0.0)
        self.calls: list[tuple[str, bool]] = []
        for name in ("store", "forget"):
            self._spy(name)
        self.thread = None
        if write_back:
            s, reserve = self.store, max(1, clean_reserve(host))
            self.thread = WriteBackThread(lambda: s.write_back(reserve), s.wait_write_back, s.wake_write_back)

    def _spy(self, name: str) -> None:
        real = getattr(self.mover, name)
        lock = self.store._lock

        def spy(*args, **kwargs):
            self.calls.append((name, lock._is_owned()))
            return real(*args, **kwargs)

        setattr(self.mover, name, spy)

    def put(self, session: str, namespace: str, keys: list[bytes], parent: bytes | None = None) -> None:
        lease = self.store.borrow(session, namespace, len(keys))
        for slot, key in zip(lease.slots, keys):
            self.host.page(slot)[:] = key[0]
        self.store.commit(session, lease.lease_id, keys, parent)

    def close(self) -> None:
        if self.thread is not None:
            self.thread.stop()
        self.reader.close()
        self.disk.close()
        self.host.close()


@pytest.fixture
def rigs(shm_prefix, tmp_path):
    made: list[Rig] = []

    def make(**kwargs) -> Rig:
        rig = Rig(f"{shm_prefix}-{len(made)}", str(tmp_path / f"disk{len(made)}"), **kwargs)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()


@pytest.mark.parametrize("write_through", [False, True])
def test_disk_writes_and_index_deletions_never_run_under_the_store_lock(rigs, write_through):
    rig = rigs(host=8, disk=12, write_through=write_through, write_back=True)
    s = rig.store
    keys = [bytes([i]) * 8 for i in range(1, 41)]
    for n, chunk in enumerate(range(0, 40, 4)):  # 40 pages through 8 host and 12 disk pages
        namespace = "A" if n % 2 else "B"
        rig.put(f"s{n % 3}", namespace, keys[chunk : chunk + 4], parent=keys[chunk - 1] if chunk else None)
        hit = s.lookup(namespace, keys[chunk : chunk + 4])
        if hit.hit_blocks:
            lease = s.acquire("reader", namespace, keys[chunk : chunk + hit.hit_blocks])
            s.release("reader", lease.lease_id)
    # Disk-only pages come back (loads, evicting host pages), prefetched or acquired.
    for namespace in ("A", "B"):
        on_disk = [key for (ns, key), b in s.blocks.items() if ns == namespace and set(b.copies) == {Tier.DISK}]
        s.prefetch("reader", namespace, on_disk[:2])
        assert s.wait_loaded(WAIT)
        match, grant = s.acquire_prefix("reader", namespace, on_disk[2:4])
        if grant is not None:
            s.release("reader", grant.lease_id)
    assert s.wait_saved(WAIT) and s.wait_loaded(WAIT)
    s.end_session("reader")
    names = {name for name, _ in rig.calls}
    assert {"store", "forget"} <= names  # both kinds of I/O happened
    assert [call for call in rig.calls if call[1]] == []  # none under the lock
    check_invariants(s, rig.disk.records())


def test_a_host_hit_completes_while_another_thread_s_eviction_write_is_in_progress(rigs):
    rig = rigs(host=4, disk=8, write_through=False)
    s = rig.store
    rig.put("w", "A", [b"a1" * 4, b"a2" * 4])
    rig.put("r", "B", [b"b1" * 4, b"b2" * 4])
    s.acquire("w", "A", [b"a2" * 4])  # keeps a2 in host: the eviction takes a1, then b1
    rig.disk.gate.clear()
    evicting = threading.Thread(target=lambda: s.borrow("w", "A", 1), daemon=True)
    evicting.start()
    assert rig.disk.entered.wait(WAIT)  # its write is inside the disk tier, held there
    assert list(s.saving) == [("A", b"a1" * 4)]

    done = threading.Event()

    def host_hit() -> None:
        assert s.lookup("B", [b"b1" * 4, b"b2" * 4]).tiers == (Tier.HOST, Tier.HOST)
        lease = s.acquire("r", "B", [b"b1" * 4, b"b2" * 4], timeout=0)
        assert lease.ready == 2
        s.release("r", lease.lease_id)
        lease = s.acquire("r", "A", [b"a1" * 4])  # the page being written is a hit too
        s.release("r", lease.lease_id)
        done.set()

    reader = threading.Thread(target=host_hit, daemon=True)
    reader.start()
    assert done.wait(WAIT), "a host hit waited for another client's disk write"
    assert evicting.is_alive() and not rig.disk.gate.is_set()  # the write was still held meanwhile
    rig.disk.gate.set()
    evicting.join(WAIT)
    reader.join(WAIT)
    assert not evicting.is_alive()
    # a1, used meanwhile, kept its host copy and gained a disk copy; the borrow ran again
    # and took the page least recently used by then (b1), written in turn.
    assert set(s.blocks[("A", b"a1" * 4)].copies) == {Tier.HOST, Tier.DISK}
    assert set(s.blocks[("B", b"b1" * 4)].copies) == {Tier.DISK}
    check_invariants(s, rig.disk.records())
