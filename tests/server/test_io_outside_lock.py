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

And at the byte level, whatever port call led there: no page hash (xxh3 of a whole page),
no populate, no disk read or write (preadv/pwrite: this pool's page copies) runs while the
store's lock is held; and a page is hashed once on each trip: at commit for the slot
table (its disk write reuses that checksum), and by the disk read's verification when it
is loaded back (the loaded page enters the slot table with the verified checksum).
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
import xxhash
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

import kvtier.mechanism.disk as disk_module
import kvtier.mechanism.host as host_module
import kvtier.mechanism.slottable as slottable_module
from kvtier.core import BlockStore, clean_reserve
from kvtier.core.invariants import check_invariants
from kvtier.mechanism.disk import DiskTier
from kvtier.mechanism.host import HostArena, NamespaceMemory
from kvtier.mechanism.io import DiskReader, WriteBackThread
from kvtier.mechanism.mover import arena_ports

LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16)
#: 16 KiB pages for the byte-level tests: a page hash is told from the slot table's entry
#: crc (ENTRY_CRC_BYTES) by its length alone, and a write-back batch of a few pages stays
#: under host.py's _PARALLEL_HASH_BYTES (hashed in the caller's thread).
BIG = PageLayout(layers=2, kv_heads=1, head_dim=128, block_tokens=16)
#: What the slot table hashes for an entry's own crc: the 512-byte entry less the crc.
ENTRY_CRC_BYTES = 512 - 8
WAIT = 10


def pattern(key: bytes, layout: PageLayout) -> np.ndarray:
    """A page's bytes, derived from its key (the key repeated): distinct keys, distinct pages."""
    return np.resize(np.frombuffer(key, dtype=np.uint8), layout.page_bytes)


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
                 write_back: bool = False, layout: PageLayout = LAYOUT) -> None:
        self.layout = layout
        self.host = HostArena(f"{prefix}-io", layout, host)
        self.disk = GatedDiskTier(directory, layout, disk, fsync="never")
        self.reader = DiskReader(self.disk, self.host, depth=2)
        self.ports = arena_ports(self.host, self.disk, self.reader)
        self.mover = self.ports.disk
        self.store = BlockStore(layout, host_pages=host, disk_pages=disk, ports=self.ports,
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
            self.host.page(slot)[:] = pattern(key, self.layout)
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


# -- the byte level ------------------------------------------------------------------------
@dataclass(frozen=True)
class ByteEvent:
    kind: str  # "hash", "populate", "pwrite" or "preadv"
    nbytes: int
    held: bool  # the store's lock was held by the thread that did it (or that handed it to a pool)
    thread: str  # that thread's name
    digest: int | None = None  # a hash's result


class _HashSpy:
    """Stands for the `xxhash` module in host.py, disk.py and slottable.py: records each
    xxh3_64_intdigest, then calls the real one; anything else is the real module's."""

    def __init__(self, spy: ByteSpy) -> None:
        self._spy = spy

    def xxh3_64_intdigest(self, data, *args, **kwargs):
        digest = xxhash.xxh3_64_intdigest(data, *args, **kwargs)
        self._spy.record("hash", memoryview(data).nbytes, digest)
        return digest

    def __getattr__(self, name):
        return getattr(xxhash, name)


class _OsSpy:
    """Stands for the `os` module in disk.py: records each pwrite and preadv (the disk
    tier's page copies), then does it; anything else is the real module's."""

    def __init__(self, spy: ByteSpy, real) -> None:
        self._spy = spy
        self._real = real

    def pwrite(self, fd, data, offset):
        self._spy.record("pwrite", memoryview(data).nbytes)
        return self._real.pwrite(fd, data, offset)

    def preadv(self, fd, buffers, offset, *args):
        self._spy.record("preadv", sum(memoryview(b).nbytes for b in buffers))
        return self._real.preadv(fd, buffers, offset, *args)

    def __getattr__(self, name):
        return getattr(self._real, name)


class ByteSpy:
    """Every page hash, populate and disk read/write of a rig, and whether the store's lock
    was held meanwhile.

    Some of that work runs on pool threads (the disk tier's writers, the arena's hashers),
    which never hold the store's lock themselves: the thread that submits the task and
    waits for it would. So a task submitted to those pools runs with the submitter's state
    (`_handed`), and a record counts the lock as held if either holds it.
    """

    def __init__(self, rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lock = rig.store._lock
        self.events: list[ByteEvent] = []
        self._handed = threading.local()
        hashes = _HashSpy(self)
        for module in (host_module, disk_module, slottable_module):
            monkeypatch.setattr(module, "xxhash", hashes)
        monkeypatch.setattr(disk_module, "os", _OsSpy(self, disk_module.os))
        real_populate = NamespaceMemory.populate

        def populate(memory, start, length):
            self.record("populate", length)
            return real_populate(memory, start, length)

        monkeypatch.setattr(NamespaceMemory, "populate", populate)
        for pool in (rig.disk._writers, rig.host._hashers):
            self._carry(pool, monkeypatch)

    def _carry(self, pool, monkeypatch: pytest.MonkeyPatch) -> None:
        real_submit = pool.submit

        def submit(fn, *args, **kwargs):
            held, thread = self.held(), self.thread()

            def task():
                self._handed.held, self._handed.thread = held, thread
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._handed.held, self._handed.thread = False, None

            return real_submit(task)

        monkeypatch.setattr(pool, "submit", submit)

    def held(self) -> bool:
        return self.lock._is_owned() or getattr(self._handed, "held", False)

    def thread(self) -> str:
        return getattr(self._handed, "thread", None) or threading.current_thread().name

    def record(self, kind: str, nbytes: int, digest: int | None = None) -> None:
        self.events.append(ByteEvent(kind, nbytes, self.held(), self.thread(), digest))

    def mark(self) -> int:
        return len(self.events)

    def since(self, mark: int, kind: str, nbytes: int | None = None) -> list[ByteEvent]:
        return [e for e in self.events[mark:] if e.kind == kind and (nbytes is None or e.nbytes == nbytes)]


@pytest.mark.parametrize("write_through", [False, True])
def test_no_page_hash_populate_or_disk_io_runs_under_the_store_lock(rigs, monkeypatch, write_through):
    rig = rigs(host=8, disk=12, write_through=write_through, write_back=True, layout=BIG)
    spy = ByteSpy(rig, monkeypatch)
    s, page_bytes = rig.store, BIG.page_bytes
    keys = [bytes([i]) * 7 + b"k" for i in range(1, 41)]
    for n, chunk in enumerate(range(0, 40, 4)):  # 40 pages through 8 host and 12 disk pages
        namespace = "A" if n % 2 else "B"
        rig.put(f"s{n % 3}", namespace, keys[chunk : chunk + 4], parent=keys[chunk - 1] if chunk else None)
        hit = s.lookup(namespace, keys[chunk : chunk + 4])
        if hit.hit_blocks:
            lease = s.acquire("reader", namespace, keys[chunk : chunk + hit.hit_blocks])
            s.release("reader", lease.lease_id)
        if n % 4 == 3:  # a write lease given back unused
            lease = s.borrow("idle", namespace, 2)
            s.release("idle", lease.lease_id)
    # Disk-only pages come back (loads, evicting host pages): prefetched, acquired whole,
    # acquired as a prefix; each read back as written.
    loaded = 0

    def disk_only(namespace: str, n: int) -> list[bytes]:  # now: loads evict, and evictions write
        keys = [key for (ns, key), b in s.blocks.items() if ns == namespace and set(b.copies) == {Tier.DISK}]
        assert len(keys) >= n, keys
        return keys[:n]

    for namespace in ("A", "B"):
        loaded += s.prefetch("reader", namespace, disk_only(namespace, 1))
        assert s.wait_loaded(WAIT)
        wanted = disk_only(namespace, 2)
        lease = s.acquire("reader", namespace, wanted)
        assert lease.ready == 2
        for slot, key in zip(lease.slots, wanted):
            assert np.array_equal(rig.host.page(slot), pattern(key, BIG))
        s.release("reader", lease.lease_id)
        wanted = disk_only(namespace, 1)
        _match, grant = s.acquire_prefix("reader", namespace, wanted)
        assert grant is not None and grant.ready == 1
        assert np.array_equal(rig.host.page(grant.slots[0]), pattern(wanted[0], BIG))
        s.release("reader", grant.lease_id)
        loaded += 3
    assert s.wait_saved(WAIT) and s.wait_loaded(WAIT)
    s.end_session("reader")

    page_hashes = spy.since(0, "hash", page_bytes)
    # The slot table's entry crc hashes 504 bytes of metadata, under the lock when `stage`
    # enters a page whose checksum is known (a loaded one): allowed, and here the proof that
    # `held` does see the lock. Nothing but pages and entries is hashed.
    entry_crcs = spy.since(0, "hash", ENTRY_CRC_BYTES)
    assert any(e.held for e in entry_crcs), "no slot table entry was written under the lock: is `held` blind?"
    assert len(page_hashes) + len(entry_crcs) == len(spy.since(0, "hash"))
    populates, writes, reads = spy.since(0, "populate"), spy.since(0, "pwrite"), spy.since(0, "preadv")
    # Every kind happened: 40 commits hashed, borrows populated, pages written and read back.
    assert len(page_hashes) >= 40 and populates and writes and len(reads) >= loaded
    assert {e.nbytes for e in writes} == {e.nbytes for e in reads} == {BIG.slot_bytes}
    under_lock = [e for e in page_hashes + populates + writes + reads if e.held]
    assert under_lock == []
    assert [call for call in rig.calls if call[1]] == []
    check_invariants(s, rig.disk.records())


@pytest.mark.parametrize("write_through", [False, True])
def test_a_page_is_hashed_once_at_commit_and_once_by_its_disk_read(rigs, monkeypatch, write_through):
    """Commit hashes each page for the slot table; its disk write (write-through, or
    write-back afterwards) reuses that checksum; a load's read verifies the page (one hash)
    and enters it in the slot table with the verified checksum, not hashed again."""
    rig = rigs(host=8, disk=16, write_through=write_through, layout=BIG)
    spy = ByteSpy(rig, monkeypatch)
    s, page_bytes = rig.store, BIG.page_bytes
    keys = [b"page-%03d" % i for i in range(4)]
    sums = {key: xxhash.xxh3_64_intdigest(pattern(key, BIG)) for key in keys}

    mark = spy.mark()  # commit: one hash per page, of that page
    rig.put("w", "A", keys)
    assert Counter(e.digest for e in spy.since(mark, "hash", page_bytes)) == Counter(sums.values())
    assert len(spy.since(mark, "pwrite")) == (4 if write_through else 0)

    mark = spy.mark()  # write-back: the pages reach disk, none hashed again
    if not write_through:
        assert s.write_back(8) == 4  # the dirty pages among the 8 next to evict less 4 free
    assert all(set(s.blocks[("A", key)].copies) == {Tier.HOST, Tier.DISK} for key in keys)
    assert spy.since(mark, "hash", page_bytes) == []
    assert len(spy.since(mark, "pwrite")) == (0 if write_through else 4)
    assert {r.checksum for r in rig.disk.records()} == set(sums.values())

    mark = spy.mark()  # the host copies go (they are clean: no write, no hash)
    lease = s.borrow("w", "B", 8)
    s.release("w", lease.lease_id)
    assert all(set(s.blocks[("A", key)].copies) == {Tier.DISK} for key in keys)
    assert spy.since(mark, "hash", page_bytes) == [] and spy.since(mark, "pwrite") == []

    mark = spy.mark()  # loaded back: one hash per page, the read's verification
    lease = s.acquire("r", "A", keys)
    assert lease.ready == 4
    assert len(spy.since(mark, "preadv")) == 4
    assert Counter(e.digest for e in spy.since(mark, "hash", page_bytes)) == Counter(sums.values())
    for slot, key in zip(lease.slots, keys):
        assert np.array_equal(rig.host.page(slot), pattern(key, BIG))
        assert rig.host.checksum(slot) == sums[key]  # in the slot table, with the verified checksum
    s.release("r", lease.lease_id)
    assert s.wait_loaded(WAIT)
    assert len(spy.since(mark, "hash", page_bytes)) == 4  # and none after
    assert [e for e in spy.events if e.held and e.kind != "hash"] == []
    check_invariants(s, rig.disk.records())


def test_a_commit_with_the_clients_checksums_hashes_nothing(rigs, monkeypatch):
    """Checksums sent with the commit (a client that hashed its pages as it wrote them) go
    into the slot table as they are, and on to disk: the daemon reads no page to hash it."""
    rig = rigs(host=8, disk=16, write_through=True, layout=BIG)
    spy = ByteSpy(rig, monkeypatch)
    s, page_bytes = rig.store, BIG.page_bytes
    keys = [b"sent-%03d" % i for i in range(4)]
    sums = [xxhash.xxh3_64_intdigest(pattern(key, BIG)) for key in keys]
    lease = s.borrow("w", "A", len(keys))
    for slot, key in zip(lease.slots, keys):
        rig.host.page(slot)[:] = pattern(key, BIG)
    mark = spy.mark()
    s.commit("w", lease.lease_id, keys, checksums=sums)
    assert spy.since(mark, "hash", page_bytes) == []
    assert len(spy.since(mark, "pwrite")) == 4  # written through, with the sent checksums
    assert [rig.host.checksum(slot) for slot in lease.slots] == sums
    assert sorted(r.checksum for r in rig.disk.records()) == sorted(sums)
    check_invariants(s, rig.disk.records())
