"""Seals: what binds a page stored in a lower tier (disk, cluster) to its identity.

A checksum of the bytes alone says a page is intact, not whose it is: a valid value
copied under another key (or another namespace's key) would pass it and be served as that
key's KV. So every lower tier stores, next to the page's xxh3-64, a 16-byte seal over the
page's identity (layout, namespace, block key) and its bytes, and checks it on every read
under the identity it was asked for. A page whose seal does not match is *misbound*:
dropped and counted, a miss, never served (docs/security.md, "Stored pages").

Two kinds, written in every value so that a reader never misreads one as the other:

    CHECKSUM  xxh3-128 of identity || xxh3-64 of the page. No secret: it catches a value
              moved between keys, namespaces or layouts, by accident or on purpose, but
              anyone who can write to the store can compute it for a page of their own.
    KEYED     BLAKE2b-128 keyed with the deployment's secret (`seal_key_file`) over
              identity || the page. A writer without the secret can neither move a value
              nor forge one. It costs a cryptographic hash of every page written and read
              (about 1 GB/s per core; hashlib releases the GIL, so I/O threads run it in
              parallel), which is why it is an option.

Nodes that share a cluster tier must share the secret (or all have none): a value sealed
with another secret, or with none, is misbound here.
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import os
import stat
from dataclasses import dataclass

import xxhash

SEAL_BYTES = 16
#: The shortest secret accepted: 128 bits.
MIN_KEY_BYTES = 16
_PERSON = b"kvtier-page-v1"  # BLAKE2b personalisation: these seals are no other protocol's MACs


class SealKind(enum.IntEnum):
    """Recorded in every stored value (one byte), so a reader checks it the right way."""

    CHECKSUM = 0
    KEYED = 1


@dataclass(frozen=True)
class PageIdentity:
    """Whose page it is: the fields a seal binds, as stored nowhere else in the value."""

    layout_id: str
    namespace: str
    key: bytes

    def encode(self) -> bytes:
        """Length-prefixed fields, so no two identities encode alike."""
        parts = (self.layout_id.encode(), self.namespace.encode(), self.key)
        return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


class Sealer:
    """Makes and checks seals of one kind (keyed when a secret is given)."""

    def __init__(self, secret: bytes | None = None) -> None:
        if secret is not None and len(secret) < MIN_KEY_BYTES:
            raise ValueError(f"a seal key needs at least {MIN_KEY_BYTES} bytes, got {len(secret)}")
        self._secret = secret[:64] if secret is not None else None  # BLAKE2b takes keys up to 64 bytes
        self.kind = SealKind.KEYED if secret is not None else SealKind.CHECKSUM

    @classmethod
    def from_file(cls, path: str) -> "Sealer":
        """The sealer of `seal_key_file` (`""`: unkeyed). Raises ValueError saying what to fix."""
        if not path:
            return cls()
        try:
            with open(path, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                secret = f.read().strip()
        except OSError as exc:
            raise ValueError(f"seal_key_file {path} cannot be read: {exc.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"seal_key_file {path} is readable by others (mode {stat.S_IMODE(mode):o}): chmod 600 it")
        if len(secret) < MIN_KEY_BYTES:
            raise ValueError(f"seal_key_file {path} holds {len(secret)} bytes; a secret needs at least {MIN_KEY_BYTES} "
                             "(e.g. head -c 32 /dev/urandom | base64 > FILE)")
        return cls(secret)

    def seal(self, identity: PageIdentity, page: memoryview | bytes, digest: int) -> bytes:
        """The seal of `page` as `identity`'s; `digest` is its xxh3-64 (computed anyway)."""
        if self._secret is None:
            return xxhash.xxh3_128_digest(identity.encode() + digest.to_bytes(8, "little"))
        mac = hashlib.blake2b(identity.encode(), digest_size=SEAL_BYTES, key=self._secret, person=_PERSON)
        mac.update(page)
        return mac.digest()

    def check(self, identity: PageIdentity, page: memoryview | bytes, digest: int, kind: int, seal: bytes) -> bool:
        """Whether `seal` (of `kind`) is this sealer's seal of `page` as `identity`'s: False
        for a page of another identity, sealed with another secret or with none."""
        return kind == self.kind and hmac.compare_digest(self.seal(identity, page, digest), seal)
