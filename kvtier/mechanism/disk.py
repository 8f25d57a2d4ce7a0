"""Disk tier: a preallocated slab file of aligned chunks plus an LMDB index.

Each page is stored as its namespace's codec encodes it (kvtier.codecs: identity by
default) in the chunks the core gave it (its extent, kvtier.core.chunks), so a page that
encodes to half its size takes half the room. The index (kvtier.mechanism.disk_index) maps
(namespace, key) to the slot, extent, codec, lengths, checksum, seal, parent key, layout and
a write sequence number, so the tier's content survives a restart. Checksum and seal are
over the stored (encoded) bytes; encoding and decoding run on the I/O threads, never under
a lock. A page stored as it is moves straight between its host slot and the slab. Ordering rule: a page's
bytes are written (and, with `fsync`, flushed) before its index entry commits, and every read
is checked against the checksum; a crash between the two leaves either no entry or an entry
whose checksum fails, and a failing page is dropped and counted, never returned. The seal
(kvtier.mechanism.seal) binds the page to its namespace, layout and key: an entry copied
under another key, or slot bytes swapped together with their entries, fail it on read under
the key asked for (misbound: dropped and counted, never returned).

The core calls `write_pages` and `forget` outside its lock, so they may run at once on
several threads (a request's eviction, the write-back thread): page writes run in
parallel, index transactions one at a time (`_index_lock`). A slot or chunk freed by a drop can
be written again before its old entry is deleted. That is safe because (1) `forget` deletes
an entry only if it is still the one forgotten (same write sequence), so a key written
again is never deleted by a late forget; (2) at open, an entry whose slot or chunks a later
entry (higher `seq`) also names is dropped: its bytes were overwritten; (3) in between, the
old entry's checksum no longer matches its chunks, so a read drops it, never serves it.

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
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from enum import Enum

import xxhash
from kvtier_client.layout import PageLayout

from kvtier.codecs import CodecChoice, decoder
from kvtier.core.chunks import DiskSpace, chunk_bytes_for, chunks_in, size_of, split
from kvtier.core.ports import PageRecord
from kvtier.mechanism.directio import aligned_buffer, open_direct
from kvtier.mechanism.disk_index import delete_if_seq, encode_key, pack_entry, unpack_entry
from kvtier.mechanism.disk_meta import INDEX_DIR, DiskLayoutMismatch, open_meta
from kvtier.mechanism.seal import PageIdentity, Sealer

__all__ = ["DiskLayoutMismatch", "DiskTier", "FsyncPolicy"]  # DiskLayoutMismatch: what opening one raises

log = logging.getLogger(__name__)

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
        chunks: int | None = None,
        codecs: CodecChoice | None = None,
    ) -> None:
        """`pages`: index entries (pages) at most; `chunks`: the slab's chunks (default:
        room for `pages` pages as they are); `codecs`: which codec writes each namespace's
        pages (default: identity for all)."""
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
        self.codecs = codecs or CodecChoice()
        self.chunk_bytes = chunk_bytes_for(layout.slot_bytes)
        self.chunks = chunks or pages * (layout.slot_bytes // self.chunk_bytes)
        self.unknown_codec = 0  # pages written by a codec this kvtier does not know (dropped as misses)
        self._bounce = threading.local()  # a slot-sized aligned buffer per I/O thread, for encoded pages
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
            size = self.chunks * self.chunk_bytes
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
        """After the tier shrank, forget entries whose slot or chunks are gone."""
        gone = [r for r in self.records()
                if r.slot >= self.pages or not r.extent or max(chunks_in(r.extent)) >= self.chunks]
        if gone:
            log.warning("disk tier shrank to %d pages: forgetting %d pages beyond it", self.pages, len(gone))
            self._delete({encode_key(r.namespace, r.key): r.seq for r in gone})  # at start: a failure is fatal

    def _drop_shadowed(self) -> None:
        """Forget entries whose slot or chunks a later-written entry also names (a crash
        between their rewrite and the old entry's deletion): only the latest is theirs."""
        slots: dict[int, PageRecord] = {}
        chunks: dict[int, PageRecord] = {}
        stale: dict[bytes, PageRecord] = {}
        for r in sorted(self.records(), key=lambda r: r.seq):
            for old in [slots.get(r.slot), *(chunks.get(c) for c in chunks_in(r.extent))]:
                if old is not None:
                    stale[encode_key(old.namespace, old.key)] = old
            slots[r.slot] = r
            chunks.update((c, r) for c in chunks_in(r.extent))
        stale = list(stale.values())
        if stale:
            log.warning("disk tier %s: forgetting %d entries whose slots were written again", self.directory, len(stale))
            self._delete({encode_key(r.namespace, r.key): r.seq for r in stale})

    # -- index ----------------------------------------------------------------
    def records(self) -> Iterator[PageRecord]:
        """Every indexed page, in key order (less those whose deletion is still pending)."""
        with self._index_lock:
            pending = dict(self._unforgotten)
        with self._env.begin(db=self._db) as txn:
            for raw_key, value in txn.cursor():
                record = unpack_entry(raw_key, value)
                if pending.get(raw_key) != record.seq:
                    yield record

    def forget(self, records: Iterable[PageRecord]) -> None:
        """Remove index entries (each only while it is still the one with the record's
        `seq`); their slots' bytes are simply overwritten later.

        Never raises for an I/O fault: the core has already let the copies go, so the keys
        are kept and deleted by the next index transaction that works, before any entry
        that transaction adds.
        """
        keys = {encode_key(r.namespace, r.key): r.seq for r in records}
        with self._index_lock:
            try:
                self._delete(keys)
            except self._faults as exc:
                self._unforgotten.update(keys)
                self._fault("write", f"removing {len(keys)} index entries", exc)

    def _delete(self, keys: dict[bytes, int]) -> None:
        with self._env.begin(write=True, db=self._db) as txn:
            self._delete_unforgotten(txn)
            delete_if_seq(txn, keys)
        self._unforgotten.clear()

    def _delete_unforgotten(self, txn) -> None:
        delete_if_seq(txn, self._unforgotten)

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
    @property
    def space(self) -> DiskSpace:
        """The slab's chunks as the core counts them; a write reserves a raw page's (every
        codec's bound: no encoding is larger than the page)."""
        return DiskSpace(self.chunks, self.chunk_bytes, -(-self.layout.page_bytes // self.chunk_bytes))

    def write_pages(self, items: Sequence[tuple[PageRecord, memoryview]]) -> list[PageRecord]:
        """Encode each page (from an aligned source: a host slot) with its namespace's codec
        and write it into the first chunks of its record's extent, `io_depth` pages in
        parallel; flush per the fsync policy, then commit the batch's index entries at once.

        Returns the records as stored (codec, lengths, checksum, sequence, and the extent
        cut to the chunks used: the caller gives back the rest). All or nothing: if any
        write, the flush or the index commit fails, no entry of the batch is committed and
        OSError is raised, after every write has ended.
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
        wait(futures)  # all ended: no write to a chunk the caller frees may still be in flight
        written = [f.result() for f in futures]
        if self.fsync is FsyncPolicy.BATCH and items:
            os.fdatasync(self._fd)
        with self._index_lock:  # sequence numbers in commit order
            seq = self._seq
            stored = []
            for r in written:
                seq += 1
                stored.append(replace(r, seq=seq))
            with self._env.begin(write=True, db=self._db) as txn:
                self._delete_unforgotten(txn)  # first: an entry below may reuse a forgotten key's chunks
                for r in stored:
                    txn.put(encode_key(r.namespace, r.key), pack_entry(r, self.layout.layout_id))
            self._unforgotten.clear()
            self._seq = seq
        return stored

    def _buffer(self) -> memoryview:
        """This thread's aligned slot-sized buffer for encoded pages (direct I/O needs alignment)."""
        buf = getattr(self._bounce, "buf", None)
        if buf is None:
            buf = self._bounce.buf = memoryview(aligned_buffer(self.layout.slot_bytes))
        return buf

    def _runs(self, extent: tuple[int, ...], buf: memoryview) -> Iterator[tuple[memoryview, int]]:
        """(piece of `buf`, slab offset) per run of `extent`, in order."""
        at, chunk = 0, self.chunk_bytes
        for start, count in zip(extent[0::2], extent[1::2]):
            yield buf[at : at + count * chunk], start * chunk
            at += count * chunk

    def _write_one(self, item: tuple[PageRecord, memoryview]) -> PageRecord:
        """Encode and pwrite one page (a page stored as it is goes straight from its host
        slot: no bounce buffer); checksum and seal are computed here, in the I/O thread."""
        record, src = item
        with src[: self.layout.page_bytes] as page:  # released even when a write fails: the caller may close src
            encoded = self.codecs.for_namespace(record.namespace, self.layout).encode(page)
            data, n = encoded.data, -(-len(encoded.data) // self.chunk_bytes)
            if n > size_of(record.extent):
                raise ValueError(f"a page of {len(data)} bytes does not fit its {size_of(record.extent)} chunks")
            extent = split(record.extent, n)[0]
            if encoded.codec:
                buf = self._buffer()
                buf[: len(data)] = data
            else:
                buf = src  # as it is: the host slot itself
            for piece, offset in self._runs(extent, buf):
                with piece:
                    written = os.pwrite(self._fd, piece, offset)
                    if written != len(piece):
                        raise OSError(f"short write to {self.slab_path}: {written} of {len(piece)} bytes")
                with self._counter_lock:
                    self.bytes_written += written
            # A host page's checksum from its publishing (hashed once); a read checks it anyway.
            raw = not encoded.codec and record.length == len(page)
            checksum = record.checksum if raw else xxhash.xxh3_64_intdigest(data)
            seal = self.sealer.seal(self._identity(record), data, checksum)
            return replace(record, length=len(page), stored=len(data), codec=encoded.codec, extent=extent,
                           checksum=checksum, seal=seal, seal_kind=self.sealer.kind)

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
        """Read a page into an aligned destination slot, verify its stored bytes (checksum,
        and seal as the record's namespace and key) and decode them there.

        False means the page is corrupt, torn, misbound or of a codec this kvtier does not
        know: the caller must drop it (and it is counted).
        """
        if len(dest) != self.layout.slot_bytes:
            raise ValueError(f"destination must be one whole slot of {self.layout.slot_bytes} bytes")
        buf = self._buffer() if record.codec else dest  # as it is: straight into the host slot
        got = 0
        try:
            for piece, offset in self._runs(record.extent, buf):
                with piece:
                    got += os.preadv(self._fd, [piece], offset)
        except OSError as exc:
            self._fault("read", f"reading chunk {record.extent[0] if record.extent else '-'}", exc)
            raise
        self._works("read")
        with self._counter_lock:
            self.bytes_read += got
        with buf[: record.stored] as data:
            return self._check(record, data, got, dest)

    def _check(self, record: PageRecord, data: memoryview, got: int, dest: memoryview) -> bool:
        """Verify the stored bytes read and decode them into `dest` (see read_page)."""
        if got != size_of(record.extent) * self.chunk_bytes or xxhash.xxh3_64_intdigest(data) != record.checksum:
            return self._dropped(record, "corrupt", "")
        if not self.sealer.check(self._identity(record), data, record.checksum, record.seal_kind, record.seal):
            return self._dropped(record, "misbound", ": its index entry is sealed as another key's or namespace's "
                                 "(moved there), or with another seal_key_file")
        if not record.codec:
            return record.stored == record.length
        codec = decoder(record.codec, self.layout)
        if codec is None:
            with self._counter_lock:
                self.unknown_codec += 1
            log.warning("disk tier %s: a page of codec id %d, which this kvtier does not know, is a miss",
                        self.directory, record.codec)
            return False
        with dest[: self.layout.page_bytes] as page:
            if not codec.decode_into(data, page):
                return self._dropped(record, "corrupt", " (it does not decode)")
        return True

    def _dropped(self, record: PageRecord, what: str, why: str) -> bool:
        with self._counter_lock:
            self.corrupt_pages += 1
            self.misbound_pages += what == "misbound"
        log.warning("dropping %s page at chunk %d of %s%s", what, record.extent[0], self.slab_path, why)
        return False

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
