"""Disk pages are bound to their identity: an index entry moved under another key or
namespace, slot bytes swapped together with their entries, and a page sealed with another
secret are all misses, never served (an index written before seals: test_format_versions.py).

The tampering is what a process with write access to the cache directory would do: it
rewrites the real LMDB index and the real slab file while the tier is closed, then the tier
is opened again (as a restarted daemon opens it) and asked for each key.
"""
from __future__ import annotations

import os

import lmdb
import pytest
from test_disk import LAYOUT, read, write

from kvtier.mechanism.disk import DiskTier, PageRecord
from kvtier.mechanism.seal import Sealer

SECRET = b"0123456789abcdef0123456789abcdef"


def index_key(namespace: str, key: bytes) -> bytes:
    ns = namespace.encode()
    return len(ns).to_bytes(2, "little") + ns + key


def tamper(directory: str, change) -> None:
    """Run `change(txn, pages_db)` on the closed tier's index, as an outside process would."""
    env = lmdb.open(os.path.join(directory, "index.lmdb"), max_dbs=2)
    try:
        pages = env.open_db(b"pages")
        with env.begin(write=True, db=pages) as txn:
            change(txn)
    finally:
        env.close()


def by_identity(tier: DiskTier) -> dict[tuple[str, bytes], PageRecord]:
    return {(r.namespace, r.key): r for r in tier.records()}


@pytest.fixture
def written(tmp_path):
    """A closed tier holding pages of two namespaces: (directory, {(namespace, key): data})."""
    directory = str(tmp_path / "disk")
    tier = DiskTier(directory, LAYOUT, 8, fsync="never")
    data = {}
    for slot, (namespace, key) in enumerate([("a", b"k0"), ("a", b"k1"), ("b", b"k0"), ("b", b"k9")]):
        _, data[namespace, key] = write(tier, slot, seed=slot, key=key, namespace=namespace)
    tier.close()
    return directory, data


def test_an_entry_copied_under_another_namespaces_key_is_a_miss(written):
    directory, data = written

    def move(txn):
        # b's entry for k9 now says what a's entry for k0 says (a's slot, a's checksum), with
        # a later write sequence, so that it, not a's entry, is taken as the slot's owner.
        value = bytearray(txn.get(index_key("a", b"k0")))
        value[21:29] = (100).to_bytes(8, "little")  # the seq field (kvtier.mechanism.disk_index)
        txn.put(index_key("b", b"k9"), bytes(value))

    tamper(directory, move)
    tier = DiskTier(directory, LAYOUT, 8, fsync="never")
    try:
        records = by_identity(tier)
        assert ("a", b"k0") not in records  # its slot was "written again": forgotten at open
        assert read(tier, records["b", b"k9"])[0] is False  # the bytes are intact, but a's
        assert tier.misbound_pages == 1 and tier.corrupt_pages == 1
        assert read(tier, records["b", b"k0"]) == (True, data["b", b"k0"])  # the untouched page still reads
    finally:
        tier.close()


def test_entries_swapped_between_keys_of_one_namespace_are_misses(written):
    directory, _ = written

    def swap(txn):
        first, second = txn.get(index_key("a", b"k0")), txn.get(index_key("a", b"k1"))
        txn.put(index_key("a", b"k0"), second)
        txn.put(index_key("a", b"k1"), first)

    tamper(directory, swap)
    tier = DiskTier(directory, LAYOUT, 8, fsync="never")
    try:
        records = by_identity(tier)
        assert [read(tier, records["a", k])[0] for k in (b"k0", b"k1")] == [False, False]
        assert tier.misbound_pages == 2
    finally:
        tier.close()


def test_slot_bytes_moved_with_their_checksum_are_a_miss(written):
    # Copy slot 2 (b/k0) over slot 0 (a/k0) and give a/k0's entry b/k0's checksum: only the
    # seal, which names the namespace, still tells them apart.
    directory, data = written
    slab = os.path.join(directory, "slab.bin")
    with open(slab, "r+b") as f:
        f.seek(2 * LAYOUT.slot_bytes)
        other = f.read(LAYOUT.slot_bytes)
        f.seek(0)
        f.write(other)

    def adopt_checksum(txn):
        mine, theirs = bytearray(txn.get(index_key("a", b"k0"))), txn.get(index_key("b", b"k0"))
        mine[13:21] = theirs[13:21]  # the checksum field (kvtier.mechanism.disk_index)
        txn.put(index_key("a", b"k0"), bytes(mine))

    tamper(directory, adopt_checksum)
    tier = DiskTier(directory, LAYOUT, 8, fsync="never")
    try:
        records = by_identity(tier)
        assert records["a", b"k0"].checksum == records["b", b"k0"].checksum
        assert read(tier, records["a", b"k0"])[0] is False
        assert tier.misbound_pages == 1
        assert read(tier, records["b", b"k0"]) == (True, data["b", b"k0"])
    finally:
        tier.close()


def test_a_keyed_tier_refuses_pages_sealed_without_its_secret(written):
    directory, _ = written
    keyed = DiskTier(directory, LAYOUT, 8, fsync="never", sealer=Sealer(SECRET))
    try:
        records = by_identity(keyed)
        assert not any(read(keyed, r)[0] for r in records.values())  # unkeyed seals: misbound here
        assert keyed.misbound_pages == 4
        record, data = write(keyed, 5, seed=50, key=b"new", namespace="a")
        assert read(keyed, record) == (True, data)
    finally:
        keyed.close()
    other = DiskTier(directory, LAYOUT, 8, fsync="never", sealer=Sealer(b"another secret of 32 bytes......"))
    try:
        assert read(other, by_identity(other)["a", b"new"])[0] is False
    finally:
        other.close()


def test_a_seal_key_file_must_be_private_and_long_enough(tmp_path):
    path = tmp_path / "seal.key"
    path.write_bytes(b"short")
    path.chmod(0o600)
    with pytest.raises(ValueError, match="at least 16"):
        Sealer.from_file(str(path))
    path.write_bytes(SECRET)
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        Sealer.from_file(str(path))
    path.chmod(0o600)
    assert Sealer.from_file(str(path)).kind == Sealer(SECRET).kind
    with pytest.raises(ValueError, match="cannot be read"):
        Sealer.from_file(str(tmp_path / "missing"))
