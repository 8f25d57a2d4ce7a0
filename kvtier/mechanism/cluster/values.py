"""The cluster tier's keys and values.

Key: `<prefix>:<layout id>:<namespace, percent-quoted>:<block key, hex>`. Printable, so an
operator can read it in `redis-cli` and write ACL key patterns per namespace
(`~kvtier:<layout id>:<namespace>:*`); two namespaces or two layouts never share a key.

Value: a 32-byte header, then the page:

    offset  size  field
    0       4     magic b"KVTP"
    4       1     format version (1)
    5       3     zero
    8       8     layout hash (first 8 bytes of the layout id's digest), little-endian
    16      8     page length in bytes, little-endian
    24      8     xxh3-64 of the page bytes, little-endian

A value whose header or checksum does not match is corrupt: dropped, never served.
"""
from __future__ import annotations

import struct
from urllib.parse import quote

import xxhash

MAGIC = b"KVTP"
VERSION = 1
HEADER = struct.Struct("<4sB3xQQQ")


def cluster_key(prefix: str, layout_id: str, namespace: str, key: bytes) -> bytes:
    return f"{prefix}:{layout_id}:{quote(namespace, safe='')}:{key.hex()}".encode()


def layout_hash(layout_id: str) -> int:
    return int(layout_id[:16].ljust(16, "0"), 16)


def encode(layout: int, page: memoryview) -> bytes:
    """Header and page in one buffer (redis-py sends a value as one bulk string): one copy."""
    header = HEADER.pack(MAGIC, VERSION, layout, page.nbytes, xxhash.xxh3_64_intdigest(page))
    return b"".join((header, page))


def decode_into(layout: int, value: bytes, out: memoryview) -> bool:
    """Copy the page of `value` into `out` if its header and checksum hold; False if not
    (the caller drops it)."""
    if len(value) != HEADER.size + out.nbytes:
        return False
    magic, version, their_layout, length, checksum = HEADER.unpack_from(value, 0)
    if magic != MAGIC or version != VERSION or their_layout != layout or length != out.nbytes:
        return False
    page = memoryview(value)[HEADER.size:]
    if xxhash.xxh3_64_intdigest(page) != checksum:
        return False
    out[:] = page
    return True
