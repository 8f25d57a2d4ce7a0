"""Disk tier: a preallocated slab file of fixed aligned slots plus an LMDB index.

The index maps (namespace, key) to the slot, length, checksum, seal, parent key, layout and
a write sequence number, so the tier's content survives a restart. Ordering rule: a page's
bytes are written (and, with `fsync`, flushed) before its index entry commits, and every read
is checked against the checksum; a crash between the two leaves either no entry or an entry
whose checksum fails, and a failing page is dropped and counted, never returned. The seal
(kvtier.mechanism.seal) binds the page to its namespace, layout and key: an entry copied
under another key, or slot bytes swapped together with their entries, fail it on read under
the key asked for (misbound: dropped and counted, never returned).

The core calls `write_pages` and `forget` outside its lock, so they may run at once on
several threads (a request's eviction, the write-back thread): page writes run in
parallel, index transactions one at a time (`_index_lock`). A slot freed by a drop can be
written again before its old entry is deleted. That is safe because (1) `forget` deletes
an entry only if it is still the one forgotten (same write sequence), so a key written
again is never deleted by a late forget; (2) at open, an entry whose slot a later entry
(higher `seq`) also names is dropped: its bytes were overwritten; (3) in between, the
old entry's checksum no longer matches the slot, so a read drops it, never serves it.

I/O faults (EIO, ENOSPC, a read-only filesystem) degrade the tier, never the daemon: a
failed write batch commits no index entry and raises OSError (the core then drops or keeps
those pages host-only), a failed read raises OSError (the load fails), a failed index
deletion is retried with the next index transaction. Each is counted in `io_errors` and
logged once per episode: a warning at the first failure after a success, an info line when
the same kind of operation works again.
"""
from __future__ import annotations

import errno
import logging
import os
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from enum import Enum

import xxhash
from kvtier_client.layout import PageLayout

from kvtier.core.ports import PageRecord
from kvtier.mechanism.directio import open_direct
from kvtier.mechanism.disk_meta import INDEX_DIR, DiskLayoutMismatch, open_meta
from kvtier.mechanism.seal import SEAL_BYTES, PageIdentity, Sealer

__all__ = ["DiskLayoutMismatch", "DiskTier", "FsyncPolicy"]  # DiskLayoutMismatch: what opening one raises

log = logging.getLogger(__name__)

#: slot, length, checksum, seq, layout_id, seal kind, seal, len(parent); the parent key follows
#: (the index format, kvtier.mechanism.formats.DISK_INDEX).
_VALUE = struct.Struct(f"<IIQQ12sB{SEAL_BYTES}sB")


def _encode_key(namespace: str, key: bytes) -> bytes:
    ns = namespace.encode()
    return len(ns).to_bytes(2, "little") + ns + key


def _decode_key(raw: bytes) -> tuple[str, bytes]:
    n = int.from_bytes(raw[:2], "little")
    return raw[2 : 2 + n].decode(), bytes(raw[2 + n :])


def _encode_tokens(tokens: tuple[int, ...] | None) -> bytes:
    """A block's token ids after its parent in the index entry, u32 little-endian each. An
    optional field: releases that read index format 2 without it ignore the trailing bytes."""
    return struct.pack(f"<{len(tokens)}I", *tokens) if tokens else b""


def _decode_tokens(raw: bytes) -> tuple[int, ...] | None:
    if not raw or len(raw) % 4:
        return None
    return struct.unpack(f"<{len(raw) // 4}I", raw)


def _delete_if_seq(txn, keys: dict[bytes, int]) -> None:
    """Delete each key whose entry still has the given write sequence: an entry written
    again since (a newer copy of the same block) stays."""
    for key, seq in keys.items():
        value = txn.get(key)
        if value is not None and _VALUE.unpack_from(value)[3] == seq:
            txn.delete(key)


class FsyncPolicy(str, Enum):
    """When page data and the index reach stable storage (docs/tiers.md, "Durability").

    batch     page data is flushed (fdatasync) before the index entries of its batch commit,
              and each index commit is synced: a crash loses nothing that was committed.
    interval  data and index are flushed together every `fsync_interval` seconds: a crash
              loses up to that much recent work; a page whose data did not reach the disk
              fails its checksum and is dropped, never served.
    never     the OS flushes when it likes: fastest; a crash can lose any recent page (still
              never served corrupt). For a cache that can always be recomputed.
    """

    BATCH = "batch"
    INTERVAL = "interval"
    NEVER = "never"


class DiskTier:
    """The slab file and its index for one layout. Byte movement only; the core decides."""

    def __init__(
        self,
        directory: str,
        layout: PageLayout,
        pages: int,
        *,
        fsync: FsyncPolicy | str = FsyncPolicy.BATCH,
        fsync_interval: float = 1.0,
        io_depth: int = 8,
        sealer: Sealer | None = None,
    ) -> None:
        if pages <= 0:
            raise ValueError(f"disk tier needs at least one page, got {pages}")
        if io_depth < 1:
            raise ValueError(f"io_depth must be at least 1, got {io_depth}")
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.layout = layout
        self.pages = pages
        self.fsync = FsyncPolicy(fsync)
        self.sealer = sealer or Sealer()
        self.corrupt_pages = 0  # reads that failed their checksum or seal (dropped)
        self.misbound_pages = 0  # of those, intact pages sealed as another key's, namespace's or secret's
        self.io_errors = 0  # failed reads, write batches, index updates and flushes
        self._failing: dict[str, int] = {}  # "read" / "write" -> failures in the current episode
        self._unforgotten: dict[bytes, int] = {}  # index key -> seq whose deletion failed: retried next transaction
        self._index_lock = threading.Lock()  # one index transaction (and `_seq`, `_unforgotten`) at a time
        self.bytes_read = 0
        self.bytes_written = 0
        self._counter_lock = threading.Lock()
        self._fd = -1
        self._writers = ThreadPoolExecutor(io_depth, thread_name_prefix="kvtier-disk-write")
        self._flusher: threading.Thread | None = None
        self._stop_flusher = threading.Event()
        synced = self.fsync is FsyncPolicy.BATCH
        import lmdb  # here, not at module level: a daemon without a disk tier runs without lmdb

        self._faults = (OSError, lmdb.Error)  # what a failing device or a full filesystem raises
        self._env = lmdb.open(
            os.path.join(directory, INDEX_DIR),
            map_size=max(64 << 20, pages * 1024),
            max_dbs=2,
            sync=synced,
            metasync=synced,
        )
        try:
            self._db = self._env.open_db(b"pages")
            self._meta = self._env.open_db(b"meta")
            open_meta(self._env, self._db, self._meta, directory, layout)  # refuses a newer kvtier's directory
            self._seq = self._max_seq()
            self.slab_path = os.path.join(directory, "slab.bin")
            self._fd, self.direct_io = open_direct(self.slab_path, os.O_RDWR | os.O_CREAT)
            size = pages * layout.slot_bytes
            if os.fstat(self._fd).st_size > size:
                os.ftruncate(self._fd, size)
            os.posix_fallocate(self._fd, 0, size)
            self._drop_out_of_range()
            self._drop_shadowed()
            if self.fsync is FsyncPolicy.INTERVAL:
                self._flusher = threading.Thread(
                    target=self._flush_every, args=(fsync_interval,), name="kvtier-disk-flush", daemon=True
                )
                self._flusher.start()
        except BaseException:
            # A refused directory (another layout) or a failed preallocation must not keep
            # the index open: LMDB forbids opening one environment twice in a process, so
            # a leaked handle would break the next, correct open of the same directory.
            self.close()
            raise

    # -- set-up ---------------------------------------------------------------
    def _max_seq(self) -> int:
        return max((r.seq for r in self.records()), default=0)

    def _drop_out_of_range(self) -> None:
        """After the tier shrank, forget entries whose slot is gone."""
        gone = [r for r in self.records() if r.slot >= self.pages]
        if gone:
            log.warning("disk tier shrank to %d pages: forgetting %d pages beyond it", self.pages, len(gone))
            self._delete({_encode_key(r.namespace, r.key): r.seq for r in gone})  # at start: a failure is fatal

    def _drop_shadowed(self) -> None:
        """Forget entries whose slot a later-written entry also names (a crash between a
        slot's rewrite and its old entry's deletion): only the latest is the slot's."""
        latest: dict[int, PageRecord] = {}
        stale = []
        for r in sorted(self.records(), key=lambda r: r.seq):
            if r.slot in latest:
                stale.append(latest[r.slot])
            latest[r.slot] = r
        if stale:
            log.warning("disk tier %s: forgetting %d entries whose slots were written again", self.directory, len(stale))
            self._delete({_encode_key(r.namespace, r.key): r.seq for r in stale})

    # -- index ----------------------------------------------------------------
    def records(self) -> Iterator[PageRecord]:
        """Every indexed page, in key order (less those whose deletion is still pending)."""
        with self._index_lock:
            pending = dict(self._unforgotten)
        with self._env.begin(db=self._db) as txn:
            for raw_key, value in txn.cursor():
                slot, length, checksum, seq, _layout, kind, seal, plen = _VALUE.unpack_from(value)
                if pending.get(raw_key) == seq:
                    continue
                namespace, key = _decode_key(raw_key)
                parent = bytes(value[_VALUE.size : _VALUE.size + plen]) if plen else None
                tokens = _decode_tokens(value[_VALUE.size + plen :])
                yield PageRecord(namespace, key, slot, parent, length, checksum, seq, seal, kind, tokens)

    def forget(self, records: Iterable[PageRecord]) -> None:
        """Remove index entries (each only while it is still the one with the record's
        `seq`); their slots' bytes are simply overwritten later.

        Never raises for an I/O fault: the core has already let the copies go, so the keys
        are kept and deleted by the next index transaction that works, before any entry
        that transaction adds.
        """
        keys = {_encode_key(r.namespace, r.key): r.seq for r in records}
        with self._index_lock:
            try:
                self._delete(keys)
            except self._faults as exc:
                self._unforgotten.update(keys)
                self._fault("write", f"removing {len(keys)} index entries", exc)

    def _delete(self, keys: dict[bytes, int]) -> None:
        with self._env.begin(write=True, db=self._db) as txn:
            self._delete_unforgotten(txn)
            _delete_if_seq(txn, keys)
        self._unforgotten.clear()

    def _delete_unforgotten(self, txn) -> None:
        _delete_if_seq(txn, self._unforgotten)

    # -- faults ---------------------------------------------------------------
    def _fault(self, kind: str, what: str, exc: BaseException) -> None:
        """Count a failed operation; warn at the first of an episode of `kind` ("read", "write")."""
        with self._counter_lock:
            self.io_errors += 1
            first = kind not in self._failing
            self._failing[kind] = self._failing.get(kind, 0) + 1
        if first:
            log.warning(
                "disk tier %s: %s failed (%s); %ss degrade the disk tier (pages dropped or kept host-only, "
                "engines recompute) and are logged again only after they work", self.directory, what, exc, kind,
            )

    def _works(self, kind: str) -> None:
        """An operation of `kind` succeeded: end its failure episode, if any."""
        if kind not in self._failing:  # unlocked fast path: a stale answer only delays the line below
            return
        with self._counter_lock:
            failures = self._failing.pop(kind, 0)
        if failures:
            log.info("disk tier %s: %ss work again after %d failures", self.directory, kind, failures)

    # -- bytes ----------------------------------------------------------------
    def write_pages(self, items: Sequence[tuple[PageRecord, memoryview]]) -> list[PageRecord]:
        """Write each page's slot from an aligned source (a host slot), `io_depth` writes in
        parallel, flush per the fsync policy, then commit the batch's index entries at once.

        Returns the records as stored (with length, checksum and sequence filled in).
        All or nothing: if any write, the flush or the index commit fails, no entry of the
        batch is committed (pages whose bytes did reach their slots are not indexed: the
        caller frees those slots) and OSError is raised, after every write has ended.
        """
        for _, src in items:
            if len(src) != self.layout.slot_bytes:
                raise ValueError(f"source must be one whole slot of {self.layout.slot_bytes} bytes")
        try:
            stored = self._write_batch(items)
        except self._faults as exc:
            self._fault("write", f"writing {len(items)} pages", exc)
            code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EIO
            raise OSError(code, f"disk tier {self.directory}: writing {len(items)} pages failed: {exc}") from exc
        self._works("write")
        return stored

    def _write_batch(self, items: Sequence[tuple[PageRecord, memoryview]]) -> list[PageRecord]:
        futures = [self._writers.submit(self._write_one, item) for item in items]
        wait(futures)  # all ended: no write to a slot the caller frees may still be in flight
        sums = [f.result() for f in futures]
        if self.fsync is FsyncPolicy.BATCH and items:
            os.fdatasync(self._fd)
        with self._index_lock:  # sequence numbers in commit order
            seq = self._seq
            stored = []
            for (record, _), (checksum, seal) in zip(items, sums):
                seq += 1
                stored.append(replace(record, length=self.layout.page_bytes, checksum=checksum, seq=seq, seal=seal,
                                      seal_kind=self.sealer.kind))
            with self._env.begin(write=True, db=self._db) as txn:
                self._delete_unforgotten(txn)  # first: an entry below may reuse a forgotten key's slot
                for r in stored:
                    parent = r.parent or b""
                    value = _VALUE.pack(r.slot, r.length, r.checksum, r.seq, self.layout.layout_id.encode(),
                                        r.seal_kind, r.seal, len(parent))
                    txn.put(_encode_key(r.namespace, r.key), value + parent + _encode_tokens(r.tokens))
            self._unforgotten.clear()
            self._seq = seq
        return stored

    def _write_one(self, item: tuple[PageRecord, memoryview]) -> tuple[int, bytes]:
        """pwrite one slot (straight from the host page: no bounce buffer); returns its
        checksum and seal (computed here, in the I/O thread, never under a lock)."""
        record, src = item
        written = os.pwrite(self._fd, src, record.slot * self.layout.slot_bytes)
        if written != len(src):
            raise OSError(f"short write to {self.slab_path}: {written} of {len(src)} bytes")
        with self._counter_lock:
            self.bytes_written += written
        page = src[: self.layout.page_bytes]
        # A host page's checksum from its publishing (hashed once); a read checks it anyway.
        checksum = record.checksum if record.length == len(page) else xxhash.xxh3_64_intdigest(page)
        return checksum, self.sealer.seal(self._identity(record), page, checksum)

    def _identity(self, record: PageRecord) -> PageIdentity:
        return PageIdentity(self.layout.layout_id, record.namespace, record.key)

    def _flush_every(self, interval: float) -> None:
        while not self._stop_flusher.wait(interval):
            self._try_flush()

    def _try_flush(self) -> None:
        try:
            self.flush()
        except self._faults as exc:
            self._fault("write", "flushing", exc)

    def flush(self) -> None:
        """Make everything written so far durable: data first, then the index."""
        os.fdatasync(self._fd)
        self._env.sync(True)

    def read_page(self, record: PageRecord, dest: memoryview) -> bool:
        """Read a page into an aligned destination slot and verify it: its checksum, and its
        seal as the record's namespace and key.

        False means the page is corrupt, torn or misbound: the caller must drop it (and it
        is counted).
        """
        if len(dest) != self.layout.slot_bytes:
            raise ValueError(f"destination must be one whole slot of {self.layout.slot_bytes} bytes")
        try:
            got = os.preadv(self._fd, [dest], record.slot * self.layout.slot_bytes)
        except OSError as exc:
            self._fault("read", f"reading slot {record.slot}", exc)
            raise
        self._works("read")
        with self._counter_lock:
            self.bytes_read += got
        page = dest[: record.length]
        if got != len(dest) or xxhash.xxh3_64_intdigest(page) != record.checksum:
            with self._counter_lock:
                self.corrupt_pages += 1
            log.warning("dropping corrupt page in slot %d of %s", record.slot, self.slab_path)
            return False
        if not self.sealer.check(self._identity(record), page, record.checksum, record.seal_kind, record.seal):
            with self._counter_lock:
                self.corrupt_pages += 1
                self.misbound_pages += 1
            log.warning("dropping misbound page in slot %d of %s: its index entry is sealed as another key's or "
                        "namespace's (moved there), or with another seal_key_file", record.slot, self.slab_path)
            return False
        return True

    def close(self) -> None:
        """Flush (unless the policy is never), close the slab and the index. A second call does nothing."""
        if self._flusher is not None:
            self._stop_flusher.set()
            self._flusher.join()
            self._flusher = None
        self._writers.shutdown()
        if self._fd >= 0 and self._unforgotten:
            self.forget([])  # one more try at the deletions that failed
        if self._fd >= 0 and self.fsync is not FsyncPolicy.NEVER:
            self._try_flush()  # a failing device must not keep the daemon from stopping
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._env.close()  # lmdb ignores repeated closes
