"""DiskTier: a real slab file and LMDB index, on a real disk (tmp_path) and on tmpfs."""
from __future__ import annotations

import errno
import os
import shutil

import numpy as np
import pytest
import xxhash
from kvtier_client.layout import PageLayout

from kvtier.core.chunks import chunk_bytes_for
from kvtier.mechanism.directio import DIRECT_ALIGN, aligned_buffer
from kvtier.mechanism.disk import DiskLayoutMismatch, PageRecord, DiskTier

LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16)  # 3072-byte pages, 4096-byte slots
CHUNKS_PER_SLOT = LAYOUT.slot_bytes // chunk_bytes_for(LAYOUT.slot_bytes)


def slot_record(namespace: str, key: bytes, slot: int, parent: bytes | None = None, **fields) -> PageRecord:
    """A record whose chunks are its slot's (as the core gives them to raw pages of a tier
    it alone writes)."""
    return PageRecord(namespace, key, slot, parent, extent=(slot * CHUNKS_PER_SLOT, CHUNKS_PER_SLOT), **fields)


@pytest.fixture(params=["real-disk", "tmpfs"])
def disk_dir(request, tmp_path, shm_prefix):
    """A directory on the real disk under tmp_path, or one under /dev/shm (tmpfs)."""
    if request.param == "real-disk":
        yield str(tmp_path / "disk")
        return
    path = os.path.join("/dev/shm", f"{shm_prefix}-disk")
    os.makedirs(path)
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.fixture
def tiers():
    """Opens DiskTiers and closes those still open at teardown."""
    opened: list[DiskTier] = []

    def open_tier(directory, pages, layout=LAYOUT, fsync="never"):
        tier = DiskTier(directory, layout, pages, fsync=fsync)
        opened.append(tier)
        return tier

    yield open_tier
    for tier in opened:
        tier.close()


def o_direct_supported(directory: str) -> bool:
    """Ask the filesystem directly whether it accepts O_DIRECT (tmpfs did not before Linux 6.6)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = os.path.join(directory, "o_direct_probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        assert exc.errno == errno.EINVAL
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def page_buffer(seed: int):
    """An aligned, slot-sized buffer whose page holds random bytes and whose padding holds 0xEE."""
    buf = aligned_buffer(LAYOUT.slot_bytes)
    data = np.random.default_rng(seed).integers(0, 256, LAYOUT.page_bytes, dtype=np.uint8).tobytes()
    buf[: LAYOUT.page_bytes] = data
    buf[LAYOUT.page_bytes :] = b"\xee" * (LAYOUT.slot_bytes - LAYOUT.page_bytes)
    return buf, data


def write(tier: DiskTier, slot: int, seed: int, key: bytes | None = None, namespace="ns", parent=None):
    buf, data = page_buffer(seed)
    [stored] = tier.write_pages([(slot_record(namespace, key or b"k%d" % slot, slot, parent), memoryview(buf))])
    buf.close()
    return stored, data


def read(tier: DiskTier, record: PageRecord) -> tuple[bool, bytes]:
    dest = aligned_buffer(LAYOUT.slot_bytes)
    ok = tier.read_page(record, memoryview(dest))
    data = bytes(dest[: LAYOUT.page_bytes])
    dest.close()
    return ok, data


def flip_byte(tier: DiskTier, slot: int, offset: int) -> None:
    with open(tier.slab_path, "r+b") as f:
        f.seek(slot * LAYOUT.slot_bytes + offset)
        old = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([old[0] ^ 0xFF]))


def test_aligned_buffer_is_page_aligned_and_rounded_up():
    buf = aligned_buffer(5000)
    assert len(buf) == 2 * DIRECT_ALIGN
    address = np.frombuffer(buf, np.uint8).ctypes.data
    assert address % DIRECT_ALIGN == 0
    buf.close()


def test_round_trip(disk_dir, tiers, record_property):
    tier = tiers(disk_dir, 8)
    # Direct I/O where the filesystem takes it, buffered otherwise; either way the
    # flag tells the truth about this directory.
    record_property("direct_io", tier.direct_io)
    assert tier.direct_io == o_direct_supported(disk_dir)
    assert os.path.getsize(tier.slab_path) == 8 * LAYOUT.slot_bytes  # preallocated

    stored = {}
    for slot, seed in ((0, 10), (5, 11), (7, 12)):
        record, data = write(tier, slot, seed, parent=b"p" if slot else None)
        assert record.length == LAYOUT.page_bytes
        assert record.checksum == xxhash.xxh3_64_intdigest(data)
        stored[slot] = (record, data)
    assert [stored[s][0].seq for s in (0, 5, 7)] == sorted({stored[s][0].seq for s in (0, 5, 7)})
    for record, data in stored.values():
        assert read(tier, record) == (True, data)
    assert sorted(tier.records(), key=lambda r: r.slot) == [stored[s][0] for s in (0, 5, 7)]
    assert stored[5][0].parent == b"p" and stored[0][0].parent is None
    assert tier.corrupt_pages == 0


def test_round_trip_with_fsync(tmp_path, tiers):
    tier = tiers(str(tmp_path / "synced"), 2, fsync="batch")
    record, data = write(tier, 1, 5)
    assert read(tier, record) == (True, data)


def test_buffers_must_be_whole_slots(tmp_path, tiers):
    tier = tiers(str(tmp_path / "d"), 2)
    small = aligned_buffer(LAYOUT.page_bytes)
    big = aligned_buffer(2 * LAYOUT.slot_bytes)
    with pytest.raises(ValueError, match="one whole slot"):
        tier.write_pages([(slot_record("ns", b"k", 0), memoryview(big)[: LAYOUT.page_bytes])])
    with pytest.raises(ValueError, match="one whole slot"):
        tier.read_page(slot_record("ns", b"k", 0), memoryview(big))
    assert list(tier.records()) == []
    small.close()
    big.close()


def test_index_and_bytes_survive_close_and_reopen(disk_dir, tiers):
    tier = tiers(disk_dir, 4)
    written = {slot: write(tier, slot, 100 + slot, namespace=f"ns{slot % 2}") for slot in range(4)}
    last_seq = max(r.seq for r, _ in written.values())
    tier.close()
    tier.close()  # idempotent

    again = tiers(disk_dir, 4)
    records = {r.slot: r for r in again.records()}
    assert records == {slot: r for slot, (r, _) in written.items()}
    for slot, (_, data) in written.items():
        assert read(again, records[slot]) == (True, data)
    again.forget([records[2]])
    new, _ = write(again, 2, 999, key=b"new", namespace="ns0")
    assert new.seq > last_seq  # sequence numbers keep increasing across restarts
    assert sorted((r.namespace, r.key) for r in again.records()) == [
        ("ns0", b"k0"), ("ns0", b"new"), ("ns1", b"k1"), ("ns1", b"k3")
    ]


def test_flipped_bytes_fail_the_checksum(disk_dir, tiers):
    tier = tiers(disk_dir, 3)
    good, good_data = write(tier, 0, 1)
    bad, _ = write(tier, 1, 2)
    flip_byte(tier, 1, 1234)
    assert read(tier, bad)[0] is False
    assert tier.corrupt_pages == 1
    assert read(tier, good) == (True, good_data)  # a neighbour is not affected
    assert tier.corrupt_pages == 1
    # The padding after the page is not part of the page: damage there is harmless.
    flip_byte(tier, 0, LAYOUT.page_bytes + 5)
    assert read(tier, good) == (True, good_data)
    # The last byte of the page is covered.
    flip_byte(tier, 0, LAYOUT.page_bytes - 1)
    assert read(tier, good)[0] is False
    assert tier.corrupt_pages == 2


def test_an_entry_whose_bytes_were_never_written_fails(disk_dir, tiers):
    # A crash after an index entry but before its data (or a stale entry) is caught too.
    tier = tiers(disk_dir, 2)
    record, _ = write(tier, 0, 3)
    assert read(tier, slot_record("ns", b"ghost", 1, length=record.length, checksum=record.checksum))[0] is False


def test_layout_mismatch_on_reopen_raises(tmp_path, tiers):
    directory = str(tmp_path / "d")
    tier = tiers(directory, 2)
    record, data = write(tier, 0, 8)
    tier.close()
    with pytest.raises(DiskLayoutMismatch, match="holds pages of PageLayout.*remove that one"):
        DiskTier(directory, PageLayout(1, 1, 64, 16), 2, fsync="never")
    again = tiers(directory, 2)  # the refused open left the directory usable
    assert read(again, next(again.records())) == (True, data)


def test_a_refused_open_keeps_nothing_open(tmp_path, tiers):
    directory = str(tmp_path / "d")
    tiers(directory, 2).close()
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(DiskLayoutMismatch) as refused:  # the traceback (and its frames) stay alive here
        DiskTier(directory, PageLayout(1, 1, 64, 16), 2, fsync="never")
    assert len(os.listdir("/proc/self/fd")) == fds, "the refused DiskTier left its index or slab open"
    del refused


def test_shrinking_forgets_out_of_range_pages(disk_dir, tiers):
    tier = tiers(disk_dir, 6)
    written = {slot: write(tier, slot, slot) for slot in range(6)}
    tier.close()
    small = tiers(disk_dir, 3)
    assert sorted(r.slot for r in small.records()) == [0, 1, 2]
    assert os.path.getsize(small.slab_path) == 3 * LAYOUT.slot_bytes
    for r in small.records():
        assert read(small, r) == (True, written[r.slot][1])
    small.close()
    grown = tiers(disk_dir, 6)  # growing back does not resurrect what was forgotten
    assert sorted(r.slot for r in grown.records()) == [0, 1, 2]
    assert os.path.getsize(grown.slab_path) == 6 * LAYOUT.slot_bytes


def test_pages_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="at least one page"):
        DiskTier(str(tmp_path / "d"), LAYOUT, 0)


# -- I/O faults: counted, logged once per episode, nothing half done ------------------------
def failing(real, tier: DiskTier, slot: int):
    """`real` (os.pwrite or os.preadv) failing with EIO at `slot` of `tier`'s slab."""
    def call(fd, buf, offset):
        if fd == tier._fd and offset == slot * LAYOUT.slot_bytes:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buf, offset)
    return call


class ReadOnlyIndex:
    """The tier's LMDB environment with every write transaction failing."""

    def __init__(self, env) -> None:
        self.env = env

    def begin(self, write=False, **kwargs):
        if write:
            import lmdb

            raise lmdb.Error("mdb_txn_commit: Input/output error")
        return self.env.begin(write=write, **kwargs)

    def __getattr__(self, name):
        return getattr(self.env, name)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvtier.mechanism.disk" and r.levelname == "WARNING"]


def test_a_failed_write_commits_none_of_its_batch(tmp_path, tiers, monkeypatch, caplog):
    caplog.set_level("INFO", logger="kvtier.mechanism.disk")
    tier = tiers(str(tmp_path / "d"), 4)
    monkeypatch.setattr(os, "pwrite", failing(os.pwrite, tier, 2))
    bufs = [page_buffer(seed)[0] for seed in range(3)]
    batch = [(slot_record("ns", b"k%d" % slot, slot), memoryview(buf)) for slot, buf in enumerate(bufs)]
    for _ in range(3):
        with pytest.raises(OSError) as failed:
            tier.write_pages(batch)
        assert failed.value.errno == errno.EIO
    # Slots 0 and 1 were written, but no entry of the batch was committed.
    assert list(tier.records()) == []
    assert tier.io_errors == 3 and len(warnings_of(caplog)) == 1  # one warning per episode
    stored = tier.write_pages(batch[:2])  # the episode ends with a write that works...
    assert [r.slot for r in tier.records()] == [0, 1] and stored[0].seq == 1
    assert "writes work again after 3 failures" in caplog.text
    with pytest.raises(OSError):
        tier.write_pages(batch)  # ...so the next failure is a new episode
    assert tier.io_errors == 4 and len(warnings_of(caplog)) == 2
    for (_, view), buf in zip(batch, bufs):
        view.release()
        buf.close()


def test_a_failed_index_write_fails_the_batch_and_defers_deletions(tmp_path, tiers, monkeypatch, caplog):
    tier = tiers(str(tmp_path / "d"), 4)
    kept, _ = write(tier, 0, 1)
    gone, _ = write(tier, 1, 2)
    monkeypatch.setattr(tier, "_env", ReadOnlyIndex(tier._env))
    tier.forget([gone])  # no exception: the deletion waits for the next transaction
    assert list(tier.records()) == [kept] and tier.io_errors == 1
    with pytest.raises(OSError, match="writing 1 pages failed"):
        write(tier, 1, 3, key=b"new")
    assert list(tier.records()) == [kept] and tier.io_errors == 2
    assert len(warnings_of(caplog)) == 1
    monkeypatch.undo()
    new, _ = write(tier, 1, 3, key=b"new")  # slot 1 reused: the deferred deletion commits with it
    tier.close()
    reopened = tiers(str(tmp_path / "d"), 4)
    assert sorted(reopened.records(), key=lambda r: r.slot) == [kept, new]


def test_a_failed_read_is_counted_and_raised(tmp_path, tiers, monkeypatch, caplog):
    caplog.set_level("INFO", logger="kvtier.mechanism.disk")
    tier = tiers(str(tmp_path / "d"), 4)
    bad, _ = write(tier, 0, 1)
    good, data = write(tier, 1, 2)
    monkeypatch.setattr(os, "preadv", failing(os.preadv, tier, 0))
    for _ in range(2):
        with pytest.raises(OSError):
            read(tier, bad)
    assert (tier.io_errors, tier.corrupt_pages, len(warnings_of(caplog))) == (2, 0, 1)
    assert read(tier, good) == (True, data)
    assert "reads work again after 2 failures" in caplog.text


# -- writes and index deletions from several threads (the core calls them outside its lock) --
def test_a_late_forget_never_deletes_a_newer_entry_of_the_same_key(tmp_path, tiers):
    tier = tiers(str(tmp_path), 4)
    old, _ = write(tier, 0, 1, key=b"k")
    new, _ = write(tier, 1, 2, key=b"k")  # the block written again, elsewhere, before the forget ran
    tier.forget([old])
    assert list(tier.records()) == [new]
    tier.forget([new])
    assert list(tier.records()) == []


def test_a_slot_rewritten_before_its_old_entry_is_deleted_keeps_only_the_newer_entry(tmp_path, tiers):
    directory = str(tmp_path)
    tier = tiers(directory, 4)
    old, _ = write(tier, 2, 1, key=b"old")
    new, data = write(tier, 2, 2, key=b"new")  # a crash now: both entries name slot 2
    assert read(tier, old)[0] is False  # the checksum catches the stale entry
    tier.close()
    again = tiers(directory, 4)
    assert list(again.records()) == [new]  # the later entry is the slot's
    assert read(again, new) == (True, data)


def test_concurrent_batches_get_distinct_increasing_sequence_numbers(tmp_path, tiers):
    import threading

    tier = tiers(str(tmp_path), 64)
    results: list[list[PageRecord]] = []

    def batch(first: int) -> None:
        bufs = [page_buffer(first + i)[0] for i in range(8)]
        items = [(slot_record("ns", b"k%d" % (first + i), first + i), memoryview(b)) for i, b in enumerate(bufs)]
        results.append(tier.write_pages(items))

    threads = [threading.Thread(target=batch, args=(8 * n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seqs = sorted(r.seq for stored in results for r in stored)
    assert seqs == list(range(1, 65))
    for stored in results:  # one batch, one transaction: consecutive numbers
        assert [r.seq for r in stored] == list(range(stored[0].seq, stored[0].seq + 8))
    assert len(list(tier.records())) == 64
