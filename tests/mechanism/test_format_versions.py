"""Format versions (kvtier.mechanism.formats) of the four things that outlive a process: the
disk slab and index (a real LMDB and slab file), the host tier's slot table (a real memfd,
and adoption through a real arena keeper), and cluster values (a real Redis Cluster).

For each: the current format round-trips; what the commit before format versions wrote
(hand-built here, byte for byte as it wrote it) is read as the current version; an older
format no longer read is dropped and counted; a newer or unknown one is refused with one
line (disk, slot table) or is a counted miss left in place (cluster).
"""
from __future__ import annotations

import logging
import os
import struct

import lmdb
import numpy as np
import pytest
import xxhash
from kvtier_client.ids import Slot
from test_disk import LAYOUT, read, write

from kvtier.codecs import Encoded
from kvtier.core.ports import PageRecord
from kvtier.mechanism.cluster import ClusterTier, FaultKind, open_backend
from kvtier.mechanism.cluster.values import HEADER, Verdict, cluster_key, decode_into, header, layout_hash
from kvtier.mechanism.disk import DiskLayoutMismatch, DiskTier
from kvtier.mechanism.disk_meta import DiskFormatRefused, check_cache_dir
from kvtier.mechanism.formats import CLUSTER_VALUE, DISK_INDEX, DISK_SLAB, SLOT_TABLE, FormatRefused, Reading
from kvtier.mechanism.host import HostArena
from kvtier.mechanism.seal import PageIdentity, Sealer
from kvtier.mechanism.slottable import SlotTable


def page_bytes(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 255, LAYOUT.page_bytes, dtype=np.uint8).tobytes()


def test_each_format_reads_its_current_version_and_refuses_a_newer_one():
    for fmt in (DISK_SLAB, DISK_INDEX, SLOT_TABLE, CLUSTER_VALUE):
        assert fmt.reading(fmt.current) is Reading.READ
        assert fmt.reading(fmt.current + 1) is Reading.REFUSE
        assert fmt.reading(None) is Reading.REFUSE  # no version at all: never guessed
        assert fmt.reading(fmt.oldest - 1) is Reading.DROP
    line = DISK_INDEX.refusal("disk tier at /c/x", 4, "start with an empty --cache-dir")
    assert line == ("disk tier at /c/x holds disk index format 4, written by a newer kvtier; this kvtier reads disk "
                    "index formats up to 3: upgrade kvtier, or start with an empty --cache-dir")


# -- disk: slab and index -----------------------------------------------------------------
def meta(directory: str) -> dict[bytes, bytes]:
    env = lmdb.open(os.path.join(directory, "index.lmdb"), max_dbs=2)
    try:
        with env.begin(db=env.open_db(b"meta")) as txn:
            return dict(txn.cursor())
    finally:
        env.close()


def set_meta(directory: str, key: bytes, value: bytes | None) -> None:
    """Change the closed tier's meta entry as another kvtier would have left it."""
    env = lmdb.open(os.path.join(directory, "index.lmdb"), max_dbs=2)
    try:
        with env.begin(write=True, db=env.open_db(b"meta")) as txn:
            txn.put(key, value) if value is not None else txn.delete(key)
    finally:
        env.close()


@pytest.fixture
def written(tmp_path):
    """A closed disk tier holding three pages: (directory, [(record, data)])."""
    directory = str(tmp_path / "cache" / LAYOUT.layout_id)
    tier = DiskTier(directory, LAYOUT, 8, fsync="never")
    pages = [write(tier, slot, seed=slot) for slot in range(3)]
    tier.close()
    return directory, pages


def test_a_disk_tier_round_trips_in_the_current_formats(written):
    directory, pages = written
    assert meta(directory)[b"format"] == b"3" and meta(directory)[b"slab_format"] == b"2"
    tier = DiskTier(directory, LAYOUT, 8, fsync="never")
    try:
        by_key = {r.key: r for r in tier.records()}
        for record, data in pages:
            assert read(tier, by_key[record.key]) == (True, data)
    finally:
        tier.close()
    check_cache_dir(os.path.dirname(directory))  # nothing to refuse


def build_todays_directory(directory: str, pages: dict[tuple[str, bytes], bytes]) -> None:
    """A disk tier directory exactly as the commit before format versions wrote it: meta
    `layout` and `format` = 2 (no `slab_format`), entries of slot, length, checksum, seq,
    layout id, seal kind, seal and parent length, pages at slot * slot_bytes."""
    os.makedirs(directory)
    slab = bytearray(8 * LAYOUT.slot_bytes)
    env = lmdb.open(os.path.join(directory, "index.lmdb"), map_size=64 << 20, max_dbs=2)
    try:
        entries, info = env.open_db(b"pages"), env.open_db(b"meta")
        with env.begin(write=True) as txn:
            txn.put(b"layout", repr(LAYOUT).encode(), db=info)
            txn.put(b"format", b"2", db=info)
            for slot, ((namespace, key), data) in enumerate(pages.items()):
                slab[slot * LAYOUT.slot_bytes : slot * LAYOUT.slot_bytes + len(data)] = data
                checksum = xxhash.xxh3_64_intdigest(data)
                seal = Sealer().seal(PageIdentity(LAYOUT.layout_id, namespace, key), data, checksum)
                value = struct.pack("<IIQQ12sB16sB", slot, len(data), checksum, slot + 1, LAYOUT.layout_id.encode(),
                                    0, seal, 0)
                txn.put(len(namespace).to_bytes(2, "little") + namespace.encode() + key, value, db=entries)
    finally:
        env.close()
    with open(os.path.join(directory, "slab.bin"), "wb") as f:
        f.write(slab)


def test_a_disk_tier_written_before_format_versions_is_read_as_current(tmp_path):
    directory = str(tmp_path / "cache" / LAYOUT.layout_id)
    pages = {("a", b"k0"): page_bytes(0), ("a", b"k1"): page_bytes(1), ("b", b"k0"): page_bytes(2)}
    build_todays_directory(directory, pages)
    check_cache_dir(str(tmp_path / "cache"))  # not refused at start
    tier = DiskTier(directory, LAYOUT, 8, fsync="never")
    try:
        records = {(r.namespace, r.key): r for r in tier.records()}
        assert set(records) == set(pages)  # every page kept: the cache survives the upgrade
        for identity, data in pages.items():
            assert read(tier, records[identity]) == (True, data)
    finally:
        tier.close()
    assert meta(directory)[b"format"] == b"3" and meta(directory)[b"slab_format"] == b"2"  # rewritten, recorded


def test_an_index_from_before_seals_is_forgotten_at_open_and_counted(written, caplog):
    directory, _ = written
    set_meta(directory, b"format", None)  # as a kvtier before seals left it
    check_cache_dir(os.path.dirname(directory))  # older: dropped at open, not refused
    with caplog.at_level(logging.WARNING):
        tier = DiskTier(directory, LAYOUT, 8, fsync="never")
    try:
        assert list(tier.records()) == []
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "forgetting 3 pages of disk index format 1" in warnings[0]
        record, data = write(tier, 0, seed=9)  # the tier works on, in the current format
        assert read(tier, record) == (True, data)
    finally:
        tier.close()
    assert meta(directory)[b"format"] == b"3"


REFUSED = {
    "newer index": (b"format", b"4", ("holds disk index format 4, written by a newer kvtier; this kvtier reads disk "
                                      "index formats up to 3: upgrade kvtier")),
    "newer slab": (b"slab_format", b"3", ("holds disk slab format 3, written by a newer kvtier; this kvtier reads "
                                          "disk slab formats up to 2: upgrade kvtier")),
    "unknown index": (b"format", b"v3", "holds disk index a format kvtier never wrote"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_disk_tier_of_a_newer_kvtier_is_refused_with_one_line_and_left_alone(written, case):
    directory, pages = written
    key, value, words = REFUSED[case]
    set_meta(directory, key, value)
    with pytest.raises(DiskFormatRefused) as at_start:
        check_cache_dir(os.path.dirname(directory))
    with pytest.raises(DiskLayoutMismatch) as at_open:  # a pool opened later: the client's FailedPrecondition
        DiskTier(directory, LAYOUT, 8, fsync="never")
    for refused in (at_start.value, at_open.value):
        line = str(refused)
        assert isinstance(refused, FormatRefused) and "\n" not in line
        assert line.startswith(f"disk tier at {directory} {words}")
        assert line.endswith("or move that directory away (or start with an empty --cache-dir) for an empty disk tier")
    # Left as the newer kvtier wrote it: that kvtier, back again, still has its pages.
    assert meta(directory)[key] == value
    set_meta(directory, key, b"3" if key == b"format" else b"2")
    tier = DiskTier(directory, LAYOUT, 8, fsync="never")
    try:
        assert len(list(tier.records())) == len(pages)
    finally:
        tier.close()


def test_the_start_check_skips_what_is_not_a_disk_tier(tmp_path):
    cache = tmp_path / "cache"
    (cache / "not-a-tier").mkdir(parents=True)
    (cache / ".kvtier.lock").write_text("123")
    (cache / "index-only" / "index.lmdb").mkdir(parents=True)  # created, never written
    check_cache_dir(str(cache))


# -- slot table ---------------------------------------------------------------------------
def memfd(size: int) -> int:
    fd = os.memfd_create("kvtier-test-slots", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


def todays_table(pages: int, entries: list[tuple[int, str, bytes, int, int]]) -> int:
    """A slot table exactly as the commit before format versions wrote it: a 4 KiB header
    (magic kvtier-slots-v1, layout id, slot_bytes, pages), then 512-byte entries of state,
    name lengths, page length, seq, checksum, names and the entry's crc last."""
    fd = memfd(4096 + pages * 512)
    os.pwrite(fd, struct.pack("<16s12sQQ", b"kvtier-slots-v1\0", LAYOUT.layout_id.encode(), LAYOUT.slot_bytes, pages), 0)
    for slot, namespace, key, seq, checksum in entries:
        body = struct.pack("<BBBBIQQ", 1, len(namespace), len(key), 0, LAYOUT.page_bytes, seq, checksum)
        body = (body + namespace.encode() + key).ljust(504, b"\0")
        os.pwrite(fd, body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)), 4096 + slot * 512)
    return fd


def test_a_slot_table_round_trips_in_the_current_format():
    fd = memfd(0)
    try:
        table = SlotTable(fd, LAYOUT, 4, keep=False)
        table.write(PageRecord("ns", b"key", Slot(2), b"parent"), LAYOUT.page_bytes, 77, 5)
        table.close()
        assert os.pread(fd, 16, 0) == b"kvtier-slots-v1\0"
        again = SlotTable(fd, LAYOUT, 4, keep=True)
        assert again.matched
        assert [(r.namespace, r.key, r.slot, r.parent, r.checksum, r.seq) for r in again.entries()] == [
            ("ns", b"key", 2, b"parent", 77, 5)]
        again.close()
    finally:
        os.close(fd)


def test_a_slot_table_written_before_format_versions_is_adopted_as_current():
    fd = todays_table(4, [(0, "a", b"k0", 1, 11), (3, "b", b"k3", 2, 33)])
    try:
        table = SlotTable(fd, LAYOUT, 4, keep=True)
        assert table.matched
        assert [(r.slot, r.namespace, r.key, r.seq, r.checksum) for r in table.entries()] == [
            (0, "a", b"k0", 1, 11), (3, "b", b"k3", 2, 33)]
        table.close()
    finally:
        os.close(fd)


def test_a_kept_table_its_daemon_never_laid_out_is_laid_out_afresh():
    fd = memfd(0)  # the daemon died between making the table and writing its header
    try:
        table = SlotTable(fd, LAYOUT, 4, keep=True)
        assert not table.matched and list(table.entries()) == []
        table.close()
    finally:
        os.close(fd)


@pytest.mark.parametrize("magic, words", [
    (b"kvtier-slots-v2\0", ("holds slot table format 2, written by a newer kvtier; this kvtier reads slot table "
                            "formats up to 1: upgrade kvtier")),
    (b"kvtier-slots-v10", "holds slot table format 10, written by a newer kvtier"),
    (b"not a slot table", "holds slot table a format kvtier never wrote"),
])
def test_a_slot_table_of_a_newer_kvtier_is_refused_and_left_as_it_was(magic, words):
    fd = todays_table(4, [(1, "a", b"k1", 1, 11)])
    os.pwrite(fd, magic, 0)
    before = os.pread(fd, 4096 + 4 * 512, 0)
    try:
        with pytest.raises(FormatRefused) as refused:
            SlotTable(fd, LAYOUT, 4, keep=True)
        line = str(refused.value)
        assert line.startswith(f"the host tier the arena keeper kept for layout {LAYOUT.layout_id} {words}")
        assert "--warm-restart-window 0" in line and "\n" not in line
        assert os.pread(fd, 4096 + 4 * 512, 0) == before  # not laid out afresh
    finally:
        os.close(fd)


def test_a_refused_host_tier_stays_with_the_keeper(shm_prefix, keeper):
    """A successor that refuses a newer kvtier's kept arena leaves every file with the keeper
    (that kvtier, started again, adopts them), where an arena that does not fit is freed."""
    name = f"{shm_prefix}-newer"
    first = HostArena(name, LAYOUT, 4, keeper=keeper.client)
    first.give(0, "ns")
    first.page(0)[:] = 7
    first.publish(first.stage([PageRecord("ns", b"k0", Slot(0), None)]))
    first.close(keep=True)
    kept = keeper.kept(LAYOUT)
    table = next(f for f in kept if f.meta["kind"] == "slots")
    os.pwrite(table.fd, b"kvtier-slots-v2\0", 0)
    with pytest.raises(FormatRefused, match="slot table format 2"):
        HostArena(name, LAYOUT, 4, keeper=keeper.client, kept=kept)
    assert sorted(f.name for f in keeper.kept(LAYOUT)) == sorted(f.name for f in kept)


# -- cluster values -----------------------------------------------------------------------
LAYOUT_HASH = layout_hash(LAYOUT.layout_id)
IDENTITY = PageIdentity(LAYOUT.layout_id, "ns", b"key")


def todays_header(page: bytes) -> bytes:
    """A value header exactly as the commit before format versions wrote it (version 2)."""
    checksum = xxhash.xxh3_64_intdigest(page)
    return struct.pack("<4sBBBxQQQ16s", b"KVTP", 2, 0, 0, LAYOUT_HASH, len(page), checksum,
                       Sealer().seal(IDENTITY, page, checksum))


def with_version(head: bytes, version: int) -> bytes:
    return head[:4] + bytes([version]) + head[5:]


def decode(head: bytes, stored: bytes) -> Verdict:
    out = memoryview(bytearray(b"\xee" * LAYOUT.page_bytes))
    verdict, _ = decode_into(LAYOUT_HASH, LAYOUT, IDENTITY, Sealer(), head, stored, out)
    assert (bytes(out) == stored) if verdict is Verdict.GOOD else (bytes(out) == b"\xee" * LAYOUT.page_bytes)
    return verdict


def test_cluster_values_of_the_current_and_todays_format_are_read():
    page = page_bytes(3)
    head = header(LAYOUT_HASH, IDENTITY, Sealer(), len(page), Encoded(0, memoryview(page)))
    assert head[4] == CLUSTER_VALUE.current == 3 and len(head) == HEADER.size
    assert with_version(head, 2) == todays_header(page)  # identity: format 2's fields, over the same bytes
    assert decode(head, page) is Verdict.GOOD
    assert decode(todays_header(page), page) is Verdict.GOOD


def test_cluster_values_of_other_formats_are_of_another_version_not_corrupt():
    page = page_bytes(4)
    head = todays_header(page)
    assert decode(with_version(head, 1), page) is Verdict.VERSION  # before seals: binds no key
    assert decode(with_version(head, 4), page) is Verdict.VERSION  # a newer kvtier's
    assert decode(with_version(head, 4) + b"a longer header", page) is Verdict.VERSION  # its header may grow
    assert decode(b"KVTX" + head[4:], page) is Verdict.CORRUPT  # not a kvtier value at all
    assert decode(head[:-1], page) is Verdict.CORRUPT


@pytest.fixture
def cluster_tier(redis_cluster):
    tier = ClusterTier(open_backend(redis_cluster.url, timeout=5.0), layout=LAYOUT)
    yield tier
    tier.close()


def test_a_cluster_value_of_a_newer_kvtier_is_a_counted_miss_left_in_the_cluster(redis_cluster, cluster_tier, caplog):
    keys = [b"k0", b"k1", b"k2"]
    pages = [page_bytes(10 + i) for i in range(3)]
    assert cluster_tier.write("ns", [(k, memoryview(p)) for k, p in zip(keys, pages)]) == 3
    store = redis_cluster.client()
    newer = cluster_key("kvtier", LAYOUT.layout_id, "ns", b"k1")
    store.hset(newer, b"h", with_version(store.hget(newer, b"h"), 4))  # as a newer node writes it

    def read_all() -> tuple[list[int | None], list[bytes]]:
        views = [memoryview(bytearray(LAYOUT.page_bytes)) for _ in keys]
        return cluster_tier.read_checked("ns", keys, views), [bytes(v) for v in views]

    with caplog.at_level(logging.WARNING):
        for round_ in (1, 2):
            checked, got = read_all()
            assert checked[1] is None and got[1] == bytes(LAYOUT.page_bytes)  # a miss, never served
            assert [got[0], got[2]] == [pages[0], pages[2]]
            assert cluster_tier.stats().faults == {FaultKind.VERSION: round_}
    assert store.exists(newer)  # left for the nodes that read it
    assert cluster_tier.present("ns", keys) == 3
    assert not cluster_tier.failing  # no fault episode: the cluster answers, writers go on
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "cluster value format 4, which this kvtier (cluster value format 3) does not read" in lines[0]


def test_a_cluster_value_of_todays_format_is_read_from_the_cluster(redis_cluster, cluster_tier):
    page = page_bytes(20)
    store = redis_cluster.client()
    store.hset(cluster_key("kvtier", LAYOUT.layout_id, "ns", b"key"), mapping={b"h": todays_header(page), b"p": page})
    view = memoryview(bytearray(LAYOUT.page_bytes))
    assert cluster_tier.read_checked("ns", [b"key"], [view]) == [xxhash.xxh3_64_intdigest(page)]
    assert bytes(view) == page
