"""The cluster tier's keys and values.

Key: `<prefix>:<layout id>:<namespace, percent-quoted>:<block key, hex>`. Printable, so an
operator can read it in `redis-cli` and write ACL key patterns per namespace
(`~kvtier:<layout id>:<namespace>:*`); two namespaces or two layouts never share a key.

Value: a 32-byte header and the page, stored as two parts of one value (RemoteStore):

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


def header(layout: int, page: memoryview, checksum: int | None = None) -> bytes:
    """The header of `page` (`checksum`: its xxh3-64 if already known); the page itself is
    stored as it is."""
    if checksum is None:
        checksum = xxhash.xxh3_64_intdigest(page)
    return HEADER.pack(MAGIC, VERSION, layout, page.nbytes, checksum)


def decode_into(layout: int, head: bytes, page: bytes, out: memoryview) -> bool:
    """Copy `page` into `out` if its header `head` and checksum hold; False if not (the
    caller drops it)."""
    if len(head) != HEADER.size or len(page) != out.nbytes:
        return False
    magic, version, their_layout, length, checksum = HEADER.unpack(head)
    if magic != MAGIC or version != VERSION or their_layout != layout or length != out.nbytes:
        return False
    if xxhash.xxh3_64_intdigest(page) != checksum:
        return False
    out[:] = page
    return True
