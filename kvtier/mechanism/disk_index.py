"""The disk tier's index entries: one LMDB value per (namespace, key), format 3
(kvtier.mechanism.formats.DISK_INDEX).

    field      size
    slot       4     the entry's slot (the core's name for the disk copy)
    length     4     the page's bytes as the engine wrote it
    stored     4     the bytes stored (the codec's encoding)
    codec      1     the codec that wrote them (kvtier.codecs)
    checksum   8     xxh3-64 of the stored bytes
    seq        8     write sequence number
    layout     12    the layout id
    seal kind  1     and the 16-byte seal of the stored bytes (kvtier.mechanism.seal)
    len(parent) 1, runs 1: the parent key, then the extent's runs (start, count; u32 each)
    then, optional, the block's token ids (u32 each), which a reader without them ignores.
"""
from __future__ import annotations

import struct

from kvtier.core.ports import PageRecord
from kvtier.mechanism.seal import SEAL_BYTES

_VALUE = struct.Struct(f"<IIIBQQ12sB{SEAL_BYTES}sBB")
_SEQ = 5  # the field `seq` in _VALUE


def encode_key(namespace: str, key: bytes) -> bytes:
    ns = namespace.encode()
    return len(ns).to_bytes(2, "little") + ns + key


def decode_key(raw: bytes) -> tuple[str, bytes]:
    n = int.from_bytes(raw[:2], "little")
    return raw[2 : 2 + n].decode(), bytes(raw[2 + n :])


def pack_entry(r: PageRecord, layout_id: str) -> bytes:
    parent = r.parent or b""
    runs = len(r.extent) // 2
    head = _VALUE.pack(r.slot, r.length, r.stored, r.codec, r.checksum, r.seq, layout_id.encode(), r.seal_kind,
                       r.seal, len(parent), runs)
    tokens = struct.pack(f"<{len(r.tokens)}I", *r.tokens) if r.tokens else b""
    return head + parent + struct.pack(f"<{2 * runs}I", *r.extent) + tokens


def unpack_entry(raw_key: bytes, value: bytes) -> PageRecord:
    slot, length, stored, codec, checksum, seq, _layout, kind, seal, plen, runs = _VALUE.unpack_from(value)
    namespace, key = decode_key(raw_key)
    at = _VALUE.size
    parent = bytes(value[at : at + plen]) if plen else None
    at += plen
    extent = struct.unpack_from(f"<{2 * runs}I", value, at)
    at += 8 * runs
    rest = value[at:]
    tokens = struct.unpack(f"<{len(rest) // 4}I", rest) if rest and not len(rest) % 4 else None
    return PageRecord(namespace, key, slot, parent, length, checksum, seq, seal, kind, tokens, codec, stored, extent)


def entry_seq(value: bytes) -> int:
    return _VALUE.unpack_from(value)[_SEQ]


#: Format 2's entries: slot, length, checksum, seq, layout, seal kind, seal, len(parent); the
#: parent and optional tokens followed. Its page was the slot's bytes, stored as it was.
_VALUE_2 = struct.Struct(f"<IIQQ12sB{SEAL_BYTES}sB")


def upgrade_entries(txn, db, chunks_per_slot: int) -> int:
    """Rewrite format 2 entries as format 3 in place: a slot is its chunks (slab format 1's
    slot i starts where chunk i * chunks_per_slot does), the page stored as it is (its
    checksum and seal, over the page, are over the stored bytes). Returns how many."""
    upgraded = 0
    for raw_key, value in list(txn.cursor(db=db)):
        slot, length, checksum, seq, layout, kind, seal, plen = _VALUE_2.unpack_from(value)
        rest = value[_VALUE_2.size :]
        head = _VALUE.pack(slot, length, length, 0, checksum, seq, layout, kind, seal, plen, 1)
        txn.put(raw_key, head + rest[:plen] + struct.pack("<2I", slot * chunks_per_slot, chunks_per_slot) + rest[plen:],
                db=db)
        upgraded += 1
    return upgraded


def delete_if_seq(txn, keys: dict[bytes, int]) -> None:
    """Delete each key whose entry still has the given write sequence: an entry written
    again since (a newer copy of the same block) stays."""
    for key, seq in keys.items():
        value = txn.get(key)
        if value is not None and entry_seq(value) == seq:
            txn.delete(key)
