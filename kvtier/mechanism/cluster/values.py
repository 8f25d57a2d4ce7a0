"""The cluster tier's keys and values.

Key: `<prefix>:<layout id>:<namespace, percent-quoted>:<block key, hex>`. Printable, so an
operator can read it in `redis-cli` and write ACL key patterns per namespace
(`~kvtier:<layout id>:<namespace>:*`); two namespaces or two layouts never share a key.

Value: a 48-byte header and the page as its codec encodes it (kvtier.mechanism.codec;
identity: the page itself), stored as two parts of one value (RemoteStore):

    offset  size  field
    0       4     magic b"KVTP"
    4       1     format version (kvtier.mechanism.formats.CLUSTER_VALUE: 2)
    5       1     seal kind (kvtier.mechanism.seal.SealKind: 0 checksum, 1 keyed)
    6       1     codec id (0 identity; one a reader does not know makes the value corrupt)
    7       1     zero
    8       8     layout hash (first 8 bytes of the layout id's digest), little-endian
    16      8     page length in bytes (decoded), little-endian
    24      8     xxh3-64 of the page bytes (decoded), little-endian
    32      16    seal of the page as (layout, namespace, block key)'s (kvtier.mechanism.seal)

A value whose header or checksum does not match is corrupt; one whose seal does not match
the key it was read under is misbound (moved from another key or namespace, or sealed with
another secret). Both are dropped, never served. A value in a format this kvtier does not
read (a newer kvtier's, during a rolling upgrade, or format 1, written before seals: it
binds no key) is of another version: a miss here, never served, and left in the store for
the nodes that read it. Only the magic and the version byte are read before the version is
judged, so a later format may change everything after them.
"""
from __future__ import annotations

import enum
import struct
from urllib.parse import quote

import xxhash

from kvtier.mechanism.codec import CODECS, IDENTITY, PageCodec
from kvtier.mechanism.formats import CLUSTER_VALUE, Reading
from kvtier.mechanism.seal import PageIdentity, Sealer

MAGIC = b"KVTP"
HEADER = struct.Struct("<4sBBBxQQQ16s")


class Verdict(enum.Enum):
    """What a fetched value turned out to be."""

    GOOD = "good"
    CORRUPT = "corrupt"  # a header, length or checksum that does not hold (or an older format)
    MISBOUND = "misbound"  # intact, but sealed as another key's, namespace's or secret's
    VERSION = "version"  # of a format this kvtier does not read (another kvtier's): left in the store


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
    return HEADER.pack(MAGIC, CLUSTER_VALUE.current, sealer.kind, codec.id, layout, page.nbytes, checksum,
                       sealer.seal(identity, page, checksum))


def value_format(head: bytes) -> int | None:
    """The format version a value's header names; None if it is no kvtier value's header."""
    return head[4] if len(head) > 4 and head[:4] == MAGIC else None


def decode_into(layout: int, identity: PageIdentity, sealer: Sealer, head: bytes, stored: bytes,
                out: memoryview) -> tuple[Verdict, int]:
    """Decode the stored page into `out` if its format, header, codec, checksum and seal as
    `identity` hold, and give the checksum it verified; otherwise say what is wrong (the
    caller drops it, or leaves a value of another version; checksum 0) and leave `out` alone."""
    found = value_format(head)
    if found is None:
        return Verdict.CORRUPT, 0
    if CLUSTER_VALUE.reading(found) is not Reading.READ:
        return Verdict.VERSION, 0
    if len(head) != HEADER.size:
        return Verdict.CORRUPT, 0
    _, _, kind, codec_id, their_layout, length, checksum, seal = HEADER.unpack(head)
    if their_layout != layout or length != out.nbytes:
        return Verdict.CORRUPT, 0
    codec = CODECS.get(codec_id)
    page = codec.decode(stored, out.nbytes) if codec is not None else None
    if page is None or xxhash.xxh3_64_intdigest(page) != checksum:
        return Verdict.CORRUPT, 0
    if not sealer.check(identity, page, checksum, kind, seal):
        return Verdict.MISBOUND, 0
    out[:] = page
    return Verdict.GOOD, checksum
