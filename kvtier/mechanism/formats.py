"""Format versions of what outlives a kvtier process: the disk slab, the disk index, the
host tier's slot table and the cluster tier's values. One constant per format, here, with
what each version changed; docs/tiers.md, "Format versions", has the upgrade rules.

A reader judges the version it finds (`Format.reading`):

    current, or older and still read   read
    older than the oldest it reads     its pages are dropped (misses), counted, logged once
    newer, or unknown                  written by a newer kvtier (a downgrade): the disk
                                       tier and the slot table refuse to start (FormatRefused,
                                       one line, exit 2); a cluster value is a miss, counted
                                       and left in place for the nodes that read it

A cache may lose pages across a format change, never serve a page it misreads. A change a
reader of the current version cannot read raises the version; one it can (a new optional
field it ignores) does not.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Reading(enum.Enum):
    """What a reader does with a format version it found."""

    READ = "read"  # the current version, or an older one still read
    DROP = "drop"  # older than any version read: its pages are misses
    REFUSE = "refuse"  # newer (or unknown): written by a newer kvtier


class FormatRefused(RuntimeError):
    """Something kept was written in a format this kvtier cannot read. Its message is one
    line: what was found, what this kvtier reads, what to do."""


@dataclass(frozen=True)
class Format:
    name: str  # how an operator's message names it: "disk index"
    current: int  # the version this kvtier writes
    oldest: int  # the oldest version it still reads

    def reading(self, found: int | None) -> Reading:
        """`found`: the version stored, None when it is unreadable (not a version at all)."""
        if found is None or found > self.current:
            return Reading.REFUSE
        return Reading.READ if found >= self.oldest else Reading.DROP

    def refusal(self, where: str, found: int | None, remedy: str) -> str:
        """The one line that refuses what `where` holds (its version `found`)."""
        what = f"format {found}, written by a newer kvtier" if found is not None else "a format kvtier never wrote"
        return (f"{where} holds {self.name} {what}; this kvtier reads {self.name} formats up to {self.current}: "
                f"upgrade kvtier, or {remedy}")


#: The slab file (slab.bin; its version is the index's meta entry `slab_format`).
#: 1  slot i at i * slot_bytes, the page as the engine wrote it in the slot's first
#:    page_bytes. Kvtier releases before this entry existed wrote it without the entry
#:    and check only the index's `format`: a slab version they cannot read must raise
#:    DISK_INDEX too, so that they refuse it.
#: 2  chunks (kvtier.core.chunks.chunk_bytes_for): a page is its codec's encoding in the
#:    chunks its index entry names. Slot i of format 1 is chunk i * (slot_bytes / chunk
#:    bytes): a format 1 slab is read as format 2, its index entries rewritten (DISK_INDEX 3).
DISK_SLAB = Format("disk slab", current=2, oldest=1)

#: The disk index (index.lmdb: the meta entry `format`; no entry reads as 1).
#: 1  entries without seals (kvtier before 6ef7fed): forgotten at open, they bind no key.
#: 2  entries carry a seal kind and a 16-byte seal (kvtier.mechanism.seal); optionally,
#:    after the parent, the block's token ids (u32 each: KV events after a restart),
#:    which a reader without them ignores.
#: 3  entries name the page's codec, stored length and chunks (kvtier.mechanism.disk_index);
#:    checksum and seal are over the stored bytes. Format 2 entries are rewritten as 3 at
#:    open (their pages stored as they are, in their slot's chunks).
DISK_INDEX = Format("disk index", current=3, oldest=2)

#: The host tier's slot table (kvtier.mechanism.slottable: its magic, kvtier-slots-v<N>).
#: 1  a 4 KiB header (magic, layout id, slot_bytes, pages) and 512-byte entries.
SLOT_TABLE = Format("slot table", current=1, oldest=1)

#: A cluster tier value (kvtier.mechanism.cluster.values: the header's byte 4).
#: 1  a header without seal (kvtier before 6ef7fed): a miss, it binds no key.
#: 2  a 48-byte header with seal kind, codec id and 16-byte seal, over the page as written.
#: 3  the same header; checksum and seal are over the stored (encoded) bytes, and a codec
#:    the reader does not know is a miss, left in the store. Format 2 values (identity only,
#:    whose stored bytes are the page) are still read.
CLUSTER_VALUE = Format("cluster value", current=3, oldest=2)

#: Clients' hints with a TTL, kept across a restart (hints.json in the pool's directory,
#: kvtier.server.hint_keeper: its `format` field).
#: 1  {"format": 1, "hints": [{namespace, key (hex), rank (kvtier.policy.classes.Rank name),
#:    expires (Unix seconds), reason}]}. Not a cache of bytes: a file it cannot read is
#:    ignored (logged) and the hints are lost, never a refusal to start.
HINTS = Format("hints file", current=1, oldest=1)
