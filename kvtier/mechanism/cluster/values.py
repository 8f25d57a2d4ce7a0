"""The cluster tier's keys and values: the tier's format, whatever the backend (a backend
stores the key and the value's two parts as they are: kvtier.mechanism.cluster.remote).

Key: `<prefix>:<layout id>:<namespace, percent-quoted>:<block key, hex>`. Printable, so an
operator can read it in the store's own tools and write per-namespace access rules by
key pattern (`kvtier:<layout id>:<namespace>:*`); two namespaces or two layouts never
share a key.

Value: a 48-byte header and the page as its codec encodes it (kvtier.codecs; identity: the
page itself), stored as two parts of one value (RemoteStore):

    offset  size  field
    0       4     magic b"KVTP"
    4       1     format version (kvtier.mechanism.formats.CLUSTER_VALUE: 3)
    5       1     seal kind (kvtier.mechanism.seal.SealKind: 0 checksum, 1 keyed)
    6       1     codec id (kvtier.codecs; one a reader does not know: a miss, left in place)
    7       1     zero
    8       8     layout hash (first 8 bytes of the layout id's digest), little-endian
    16      8     page length in bytes (decoded), little-endian
    24      8     xxh3-64 of the stored (encoded) bytes, little-endian
    32      16    seal of the stored bytes as (layout, namespace, block key)'s (kvtier.mechanism.seal)

Format 2 wrote identity only, so its checksum and seal, over the page, are over the stored
bytes too: it is read as format 3.

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
from kvtier_client.layout import PageLayout

from kvtier.codecs import Encoded, decoder
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
    CODEC = "codec"  # intact, of a codec this kvtier does not know (a newer kvtier's): left in the store

#: read_checked's answer for a good page that was decoded: its checksum is not known (hash it).
UNHASHED = -1


def cluster_key(prefix: str, layout_id: str, namespace: str, key: bytes) -> bytes:
    return f"{prefix}:{layout_id}:{quote(namespace, safe='')}:{key.hex()}".encode()


def layout_hash(layout_id: str) -> int:
    return int(layout_id[:16].ljust(16, "0"), 16)


def header(layout: int, identity: PageIdentity, sealer: Sealer, page_bytes: int, encoded: Encoded,
           checksum: int | None = None) -> bytes:
    """The header of a page of `page_bytes` stored as `identity`, encoded as `encoded` (what
    to store after it: `encoded.data`); `checksum`: the stored bytes' xxh3-64 if known."""
    if checksum is None:
        checksum = xxhash.xxh3_64_intdigest(encoded.data)
    return HEADER.pack(MAGIC, CLUSTER_VALUE.current, sealer.kind, encoded.codec, layout, page_bytes, checksum,
                       sealer.seal(identity, encoded.data, checksum))


def value_format(head: bytes) -> int | None:
    """The format version a value's header names; None if it is no kvtier value's header."""
    return head[4] if len(head) > 4 and head[:4] == MAGIC else None


def codec_of(head: bytes) -> int:
    return head[6]


def decode_into(layout: int, page_layout: PageLayout, identity: PageIdentity, sealer: Sealer, head: bytes,
                stored: bytes, out: memoryview) -> tuple[Verdict, int]:
    """Decode the stored page into `out` if its format, header, checksum, seal as `identity`
    and codec hold, and give the page's checksum (UNHASHED for a page that was decoded);
    otherwise say what is wrong (the caller drops it, or leaves a value of another version
    or codec; checksum 0) and leave `out` alone, or, for a page that does not decode,
    partly written."""
    found = value_format(head)
    if found is None:
        return Verdict.CORRUPT, 0
    if CLUSTER_VALUE.reading(found) is not Reading.READ:
        return Verdict.VERSION, 0
    if len(head) != HEADER.size:
        return Verdict.CORRUPT, 0
    _, _, kind, codec_id, their_layout, length, checksum, seal = HEADER.unpack(head)
    if their_layout != layout or length != out.nbytes or xxhash.xxh3_64_intdigest(stored) != checksum:
        return Verdict.CORRUPT, 0
    if not sealer.check(identity, stored, checksum, kind, seal):
        return Verdict.MISBOUND, 0
    if codec_id == 0:
        if len(stored) != out.nbytes:
            return Verdict.CORRUPT, 0
        out[:] = stored
        return Verdict.GOOD, checksum
    codec = decoder(codec_id, page_layout)
    if codec is None:
        return Verdict.CODEC, 0
    return (Verdict.GOOD, UNHASHED) if codec.decode_into(stored, out) else (Verdict.CORRUPT, 0)
