"""The cluster tier's keys and values.

Key: `<prefix>:<layout id>:<namespace, percent-quoted>:<block key, hex>`. Printable, so an
operator can read it in `redis-cli` and write ACL key patterns per namespace
(`~kvtier:<layout id>:<namespace>:*`); two namespaces or two layouts never share a key.

Value: a 48-byte header and the page as its codec encodes it (kvtier.mechanism.codec;
identity: the page itself), stored as two parts of one value (RemoteStore):

    offset  size  field
    0       4     magic b"KVTP"
    4       1     format version (2)
    5       1     seal kind (kvtier.mechanism.seal.SealKind: 0 checksum, 1 keyed)
    6       1     codec id (0 identity; one a reader does not know makes the value corrupt)
    7       1     zero
    8       8     layout hash (first 8 bytes of the layout id's digest), little-endian
    16      8     page length in bytes (decoded), little-endian
    24      8     xxh3-64 of the page bytes (decoded), little-endian
    32      16    seal of the page as (layout, namespace, block key)'s (kvtier.mechanism.seal)

A value whose header or checksum does not match is corrupt (so is a value of format 1,
written before seals: it binds no key); one whose seal does not match the key it was read
under is misbound (moved from another key or namespace, or sealed with another secret).
Both are dropped, never served.
"""
from __future__ import annotations

import enum
import struct
from urllib.parse import quote

import xxhash

from kvtier.mechanism.codec import CODECS, IDENTITY, PageCodec
from kvtier.mechanism.seal import PageIdentity, Sealer

MAGIC = b"KVTP"
VERSION = 2
HEADER = struct.Struct("<4sBBBxQQQ16s")


class Verdict(enum.Enum):
    """What a fetched value turned out to be."""

    GOOD = "good"
    CORRUPT = "corrupt"  # a header, length or checksum that does not hold (or an older format)
    MISBOUND = "misbound"  # intact, but sealed as another key's, namespace's or secret's


def cluster_key(prefix: str, layout_id: str, namespace: str, key: bytes) -> bytes:
    return f"{prefix}:{layout_id}:{quote(namespace, safe='')}:{key.hex()}".encode()


def layout_hash(layout_id: str) -> int:
    return int(layout_id[:16].ljust(16, "0"), 16)


def header(layout: int, identity: PageIdentity, sealer: Sealer, page: memoryview, checksum: int | None = None,
           codec: PageCodec = IDENTITY) -> bytes:
    """The header of `page` stored as `identity` (`checksum`: its xxh3-64 if already
    known) and encoded by `codec` (what to store after it: `codec.encode(page)`)."""
    if checksum is None:
        checksum = xxhash.xxh3_64_intdigest(page)
    return HEADER.pack(MAGIC, VERSION, sealer.kind, codec.id, layout, page.nbytes, checksum,
                       sealer.seal(identity, page, checksum))


def decode_into(layout: int, identity: PageIdentity, sealer: Sealer, head: bytes, stored: bytes,
                out: memoryview) -> tuple[Verdict, int]:
    """Decode the stored page into `out` if its header, codec, checksum and seal as
    `identity` hold, and give the checksum it verified; otherwise say what is wrong (the
    caller drops it; checksum 0) and leave `out` alone."""
    if len(head) != HEADER.size:
        return Verdict.CORRUPT, 0
    magic, version, kind, codec_id, their_layout, length, checksum, seal = HEADER.unpack(head)
    if magic != MAGIC or version != VERSION or their_layout != layout or length != out.nbytes:
        return Verdict.CORRUPT, 0
    codec = CODECS.get(codec_id)
    page = codec.decode(stored, out.nbytes) if codec is not None else None
    if page is None or xxhash.xxh3_64_intdigest(page) != checksum:
        return Verdict.CORRUPT, 0
    if not sealer.check(identity, page, checksum, kind, seal):
        return Verdict.MISBOUND, 0
    out[:] = page
    return Verdict.GOOD, checksum
