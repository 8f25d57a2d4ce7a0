"""The host tier's slot table: which cached page each host slot holds, kept in a memfd that
the arena keeper holds (kvtier.mechanism.keeper), so that it outlives the daemon process
(warm restart) while no file system path names it.

    layout   a 4 KiB header, then one 512-byte entry per slot

    header  magic, layout id, slot_bytes, pages      (a table of another shape is not adopted)
            the magic names the format: kvtier-slots-v<N> (kvtier.mechanism.formats.SLOT_TABLE);
            a table of a newer kvtier is refused (FormatRefused), never laid out afresh
    entry   state, lengths, page length, seq, page checksum, namespace, key, parent, crc

Why a crash at any instant leaves it consistent: the daemon writes an entry (state CACHED,
the page's xxh3-64, then the entry's own crc, last) only once the page's bytes are in the
slot and will not change, and clears it (one byte, state FREE) before the slot can be handed
to anyone else. A process crash leaves memory as it was at that instant: an entry being
written fails its crc, a cleared one says FREE; either way the slot is simply free at the
next start. A page whose bytes no longer match its entry's checksum (an engine that wrote
into a read lease, a torn write) is dropped, never adopted. Nothing here survives a reboot,
nor the keeper's end.
"""
from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator, Sequence

import numpy as np
import xxhash
from kvtier_client.ids import Slot
from kvtier_client.layout import PageLayout

from kvtier.core.ports import PageRecord
from kvtier.mechanism.formats import SLOT_TABLE, FormatRefused, Reading

_MAGIC_PREFIX = b"kvtier-slots-v"
_HEADER = struct.Struct("<16s12sQQ")  # magic, layout id, slot_bytes, pages
_HEADER_BYTES = 4096
_ENTRY_BYTES = 512
_FIELDS = struct.Struct("<BBBBIQQ")  # state, len(namespace), len(key), len(parent), length, seq, checksum
_NAMES = _ENTRY_BYTES - 8 - _FIELDS.size  # namespace + key + parent bytes
_CACHED, _FREE = 1, 0


def _magic(version: int) -> bytes:
    return (_MAGIC_PREFIX + str(version).encode()).ljust(16, b"\0")


def _check_version(header: bytes, layout: PageLayout) -> None:
    """Refuse a kept table that a newer kvtier wrote, or that no kvtier did; one never laid
    out (its daemon died first: zeros) or of a version no longer read is simply not adopted."""
    magic = header[:16]
    if not magic.strip(b"\0"):
        return
    digits = magic[len(_MAGIC_PREFIX) :].rstrip(b"\0")
    found = int(digits) if magic.startswith(_MAGIC_PREFIX) and digits.isdigit() else None
    if SLOT_TABLE.reading(found) is Reading.REFUSE:
        raise FormatRefused(SLOT_TABLE.refusal(
            f"the host tier the arena keeper kept for layout {layout.layout_id}", found,
            "start with --warm-restart-window 0 for an empty host tier (the keeper frees it after its window)"))


class SlotTable:
    """The slot table of one host arena, in a file the caller opened (a memfd). The daemon
    that owns the arena is the only writer; no client is ever given this file."""

    def __init__(self, fd: int, layout: PageLayout, pages: int, *, keep: bool) -> None:
        """Map the table in `fd` keeping its entries (`keep`, and only if it was written for
        this layout and size: `matched`), or lay it out afresh with every slot free."""
        self.layout = layout
        self.pages = pages
        size = _HEADER_BYTES + pages * _ENTRY_BYTES
        header = _HEADER.pack(_magic(SLOT_TABLE.current), layout.layout_id.encode(), layout.slot_bytes, pages)
        current = os.pread(fd, _HEADER.size, 0)
        if keep:
            _check_version(current, layout)
        self.matched = keep and current == header and os.fstat(fd).st_size == size
        if not self.matched:
            os.ftruncate(fd, 0)  # every entry of another shape is void
            os.ftruncate(fd, size)
            os.pwrite(fd, header, 0)
        self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._entries = np.frombuffer(self._mm, dtype=np.uint8, offset=_HEADER_BYTES).reshape(pages, _ENTRY_BYTES)

    def write(self, record: PageRecord, length: int, checksum: int, seq: int) -> None:
        """Record that `record.slot` holds this page, its bytes final and checksummed."""
        namespace = record.namespace.encode()
        parent = record.parent or b""
        names = namespace + record.key + parent
        if len(names) > _NAMES:
            raise ValueError(f"namespace, key and parent of {len(names)} bytes do not fit a slot entry ({_NAMES})")
        body = _FIELDS.pack(_CACHED, len(namespace), len(record.key), len(parent), length, seq, checksum) + names
        body = body.ljust(_ENTRY_BYTES - 8, b"\0")
        at, mm = _HEADER_BYTES + record.slot * _ENTRY_BYTES, self._mm
        mm[at] = _FREE  # never valid while half written, even before the crc is checked
        mm[at + 1 : at + _ENTRY_BYTES] = body[1:] + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
        mm[at] = _CACHED

    def checksum(self, slot: int) -> int | None:
        """The checksum a published page was entered with; None if the slot holds none."""
        raw = self._entries[slot, : _FIELDS.size].tobytes()
        state, *_, checksum = _FIELDS.unpack(raw)
        return checksum if state == _CACHED else None

    def clear(self, slots: Sequence[int]) -> None:
        """These slots hold no published page any more (before anyone may reuse them)."""
        for slot in slots:
            self._entries[slot, 0] = _FREE

    def entries(self) -> Iterator[PageRecord]:
        """Every slot whose entry is complete (state CACHED and its crc matches), in slot order."""
        table = self._mm[_HEADER_BYTES:]  # one copy, then plain bytes slices: adoption time is per entry
        for slot in np.flatnonzero(self._entries[:, 0] == _CACHED).tolist():
            raw = table[slot * _ENTRY_BYTES : (slot + 1) * _ENTRY_BYTES]
            (crc,) = struct.unpack_from("<Q", raw, _ENTRY_BYTES - 8)
            if xxhash.xxh3_64_intdigest(raw[: _ENTRY_BYTES - 8]) != crc:
                continue
            _, ns_len, key_len, parent_len, length, seq, checksum = _FIELDS.unpack_from(raw)
            at = _FIELDS.size
            namespace = raw[at : at + ns_len].decode(errors="replace")
            key = raw[at + ns_len : at + ns_len + key_len]
            parent = raw[at + ns_len + key_len : at + ns_len + key_len + parent_len] or None
            yield PageRecord(namespace, key, Slot(slot), parent, length, checksum, seq)

    def close(self) -> None:
        del self._entries
        self._mm.close()
