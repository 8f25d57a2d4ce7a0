"""ClusterTier: one page layout's pages on a RemoteStore, as batches.

Every fault is a miss: a dead shard, a failover or reshard in progress, a timeout, an
key the store dropped to make room, a store that is down. It is counted by kind, logged once when
an episode of faults begins and once when calls succeed again, and never raised to the
caller. A value that fails its header or checksum (corrupt), or whose seal is not that of
the key it was read under (misbound: moved from another key or namespace, or sealed with
another secret; kvtier.mechanism.seal), is deleted from the store and counted: no node
reads it again. A value in a format, or of a codec, this kvtier does not read (a newer
kvtier's, while a rolling upgrade is under way) is a miss, counted and logged once per
format or codec, and left in the store for the nodes that read it.

Each namespace's pages are written with its codec (kvtier.codecs, `codecs`), encoded on
the writer's thread; reads decode on the reader's workers.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvtier_client.layout import PageLayout

from kvtier.codecs import CodecChoice
from kvtier.mechanism.cluster.remote import FaultKind, RemoteFault, RemoteMemory, RemoteStore
from kvtier.mechanism.cluster.values import (
    HEADER, Verdict, cluster_key, codec_of, decode_into, header, layout_hash, value_format,
)
from kvtier.mechanism.formats import CLUSTER_VALUE
from kvtier.mechanism.seal import PageIdentity, Sealer

log = logging.getLogger(__name__)

#: Called with (operation, seconds) for every batch: "exists", "get", "put".
LatencyObserver = Callable[[str, float], None]


@dataclass
class ClusterStats:
    """Counters of one ClusterTier (read under its lock: `ClusterTier.stats`)."""

    looked_up: int = 0  # keys asked about by lookups (after the local tiers missed)
    found: int = 0  # of those, present in the cluster (the hit prefix)
    pages_read: int = 0  # pages loaded from the cluster, checksums verified
    bytes_read: int = 0
    read_misses: int = 0  # pages asked for that were absent (evicted there, or never stored)
    pages_written: int = 0
    bytes_written: int = 0  # as the engine wrote them
    stored_bytes_written: int = 0  # as stored (encoded): bytes_written / this is the codec's ratio
    writes_dropped: int = 0  # pages not written: the queue was full or the cluster down
    faults: Counter = field(default_factory=Counter)  # FaultKind -> keys failed
    memory: RemoteMemory | None = None  # the store's own figures, last read


class ClusterTier:
    """Pages of one layout on `store` (per-namespace stores in `namespace_stores`, for
    clusters that give each tenant its own ACL user)."""

    #: How long the store's memory figures are reused before asking again.
    MEMORY_TTL = 5.0

    def __init__(self, store: RemoteStore, *, layout: PageLayout, prefix: str = "kvtier",
                 namespace_stores: Mapping[str, RemoteStore] | None = None,
                 observer: LatencyObserver | None = None, sealer: Sealer | None = None,
                 codecs: CodecChoice | None = None) -> None:
        """`codecs` encode the pages this node writes (reads decode each value with the
        codec its header names)."""
        self.store = store
        self.sealer = sealer or Sealer()
        self.codecs = codecs or CodecChoice()
        self.layout = layout
        self.page_bytes = layout.page_bytes
        self.layout_id = layout.layout_id
        self.prefix = prefix
        self.namespace_stores = dict(namespace_stores or {})
        self.observer = observer
        self._layout = layout_hash(self.layout_id)
        self._lock = threading.Lock()
        self._stats = ClusterStats()
        self._episode: Counter = Counter()  # faults since the last success; empty = healthy
        self._other_formats: set[str] = set()  # value formats and codecs not read here, each logged once
        self._memory_at = 0.0

    # -- batches ----------------------------------------------------------------
    def present(self, namespace: str, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the cluster holds (one round trip per node)."""
        if not keys:
            return 0
        replies = self._call("exists", namespace, lambda s, ks: s.exists(ks), keys)
        found = 0
        for reply in replies:
            if reply is not True:
                break
            found += 1
        with self._lock:
            self._stats.looked_up += len(keys)
            self._stats.found += found
        return found

    def read(self, namespace: str, keys: Sequence[bytes], views: Sequence[memoryview]) -> list[bool]:
        """Fetch each key's page into its view; False where it is absent, failed, corrupt or
        misbound (such a value is deleted from the store)."""
        return [checksum is not None for checksum in self.read_checked(namespace, keys, views)]

    def read_checked(self, namespace: str, keys: Sequence[bytes], views: Sequence[memoryview]) -> list[int | None]:
        """`read`, giving each page's checksum it verified (None where `read` says False),
        so the host tier need not hash the page again."""
        replies = self._call("get", namespace, lambda s, ks: s.get(ks), keys)
        ok: list[int | None] = []
        bad = {Verdict.CORRUPT: [], Verdict.MISBOUND: [], Verdict.VERSION: [], Verdict.CODEC: []}
        absent = 0
        for key, reply, view in zip(keys, replies, views):
            verdict, checksum = None, 0
            if isinstance(reply, tuple):
                verdict, checksum = decode_into(self._layout, self.layout, self.identity(namespace, key), self.sealer,
                                                *reply, view)
                if verdict is Verdict.VERSION:
                    bad[verdict].append(f"cluster value format {value_format(reply[0])}")
                elif verdict is Verdict.CODEC:
                    bad[verdict].append(f"codec id {codec_of(reply[0])}")
                elif verdict is not Verdict.GOOD:
                    bad[verdict].append(key)
            absent += reply is None
            ok.append(checksum if verdict is Verdict.GOOD else None)
        if bad[Verdict.CORRUPT]:
            self._drop(namespace, bad[Verdict.CORRUPT], FaultKind.CORRUPT, "failed their header or checksum")
        if bad[Verdict.MISBOUND]:
            self._drop(namespace, bad[Verdict.MISBOUND], FaultKind.MISBOUND,
                       "are sealed as another key's, namespace's or layout's (moved there), or with another "
                       "seal_key_file than this node's (every node must share one)")
        if bad[Verdict.VERSION] or bad[Verdict.CODEC]:
            self._other_format(namespace, bad[Verdict.VERSION] + bad[Verdict.CODEC])
        pages = sum(checksum is not None for checksum in ok)
        with self._lock:
            self._stats.pages_read += pages
            self._stats.bytes_read += pages * self.page_bytes
            self._stats.read_misses += absent
        return ok

    def _drop(self, namespace: str, keys: list[bytes], kind: FaultKind, why: str) -> None:
        with self._lock:
            self._stats.faults[kind] += len(keys)
        log.warning("cluster tier: %d values of %r %s; deleted, never served", len(keys), namespace, why,
                    extra={"pool": self.layout_id, "fault": kind.value})
        self._call("delete", namespace, lambda s, ks: s.delete(ks), keys)

    def _other_format(self, namespace: str, found: list[str]) -> None:
        """Values of formats or codecs this kvtier does not read: misses, counted, never
        deleted (the nodes of the kvtier that wrote them read them); one line each."""
        with self._lock:
            self._stats.faults[FaultKind.VERSION] += len(found)
            new = set(found) - self._other_formats
            self._other_formats |= new
        for what in sorted(new):
            log.warning("cluster tier: values of %r in %s, which this kvtier (cluster value format %d) does not "
                        "read, are misses on this node and left for the nodes that read them; they end with "
                        "the rolling upgrade", namespace, what, CLUSTER_VALUE.current,
                        extra={"pool": self.layout_id, "fault": FaultKind.VERSION.value})

    def identity(self, namespace: str, key: bytes) -> PageIdentity:
        return PageIdentity(self.layout_id, namespace, key)

    def write(self, namespace: str, items: Sequence[tuple[bytes, memoryview]]) -> int:
        """Store each (key, page); returns how many were stored."""
        return sum(self.write_each(namespace, items))

    def write_each(self, namespace: str, items: Sequence[tuple[bytes, memoryview]],
                   checksums: Sequence[int | None] | None = None) -> list[bool]:
        """Store each (key, page); whether each was stored. `checksums`: each page's xxh3-64
        where already known (the host tier computed it at commit), None to compute it."""
        sums = checksums or [None] * len(items)
        codec = self.codecs.for_namespace(namespace, self.layout)
        values, stored_bytes = [], 0
        for (key, page), checksum in zip(items, sums):
            encoded = codec.encode(page)
            stored_bytes += len(encoded.data)
            known = checksum if not encoded.codec else None  # a host checksum is the page's, not an encoding's
            values.append((key, (header(self._layout, self.identity(namespace, key), self.sealer, len(page), encoded,
                                        known), encoded.data)))
        replies = self._call("put", namespace, lambda s, kvs: s.put(kvs), values, keyed=True)
        ok = [r is True for r in replies]
        stored = sum(ok)
        with self._lock:
            self._stats.pages_written += stored
            self._stats.bytes_written += stored * self.page_bytes
            self._stats.stored_bytes_written += stored_bytes * stored // max(1, len(items))
        return ok

    def _call(self, op: str, namespace: str, run: Callable, items: Sequence, *, keyed: bool = False) -> list:
        """Run one batch on the namespace's store with its keys made cluster keys; count
        the faults in it. Never raises."""
        if not items:
            return []
        store = self.namespace_stores.get(namespace, self.store)
        if keyed:
            batch = [(self.key(namespace, k), v) for k, v in items]
        else:
            batch = [self.key(namespace, k) for k in items]
        start = time.perf_counter()
        replies = run(store, batch)
        if self.observer is not None:
            self.observer(op, time.perf_counter() - start)
        faults = [r for r in replies if isinstance(r, RemoteFault)]
        if faults:
            first = faults[0]
            self._fault(first.kind, f"{op} of {len(items)} keys of {namespace!r}: {first.detail}",
                        Counter(f.kind for f in faults))
        else:
            self._healthy()
        return replies

    def key(self, namespace: str, key: bytes) -> bytes:
        return cluster_key(self.prefix, self.layout_id, namespace, key)

    # -- health -------------------------------------------------------------------
    def _fault(self, kind: FaultKind, detail: str, kinds: Counter) -> None:
        with self._lock:
            starts = not self._episode
            self._episode.update(kinds)
            self._stats.faults.update(kinds)
        if starts:
            log.warning("cluster tier: %s; such keys are misses until the cluster answers again", detail,
                        extra={"pool": self.layout_id, "fault": kind.value})

    def _healthy(self) -> None:
        if not self._episode:
            return
        with self._lock:
            episode, self._episode = self._episode, Counter()
        if episode:
            log.info("cluster tier answers again after %d failed keys (%s)", sum(episode.values()),
                     ", ".join(f"{k.value} {n}" for k, n in sorted(episode.items())), extra={"pool": self.layout_id})

    @property
    def failing(self) -> bool:
        """The last batch failed (an episode is under way): writers skip the cluster."""
        return bool(self._episode)

    # -- figures ------------------------------------------------------------------
    def stats(self) -> ClusterStats:
        """A copy of the counters, with the store's memory figures (re-read every
        MEMORY_TTL seconds; None while the store cannot say)."""
        now = time.monotonic()
        if now - self._memory_at >= self.MEMORY_TTL:
            self._memory_at = now
            try:
                memory = self.store.memory()
            except RemoteFault:
                memory = None
            with self._lock:
                self._stats.memory = memory
        with self._lock:
            s = self._stats
            return ClusterStats(s.looked_up, s.found, s.pages_read, s.bytes_read, s.read_misses, s.pages_written,
                                s.bytes_written, s.stored_bytes_written, s.writes_dropped, Counter(s.faults), s.memory)

    def dropped(self, n: int) -> None:
        """`n` pages were not offered to the store (the writer's queue was full)."""
        with self._lock:
            self._stats.writes_dropped += n

    @property
    def value_bytes(self) -> int:
        """What one page takes in the store, header included (before the store's own
        overhead): as this node's writes so far were encoded, on average."""
        with self._lock:
            s = self._stats
            stored = s.stored_bytes_written // s.pages_written if s.pages_written else self.page_bytes
        return HEADER.size + stored

    def close(self) -> None:
        self.store.close()
        for store in self.namespace_stores.values():
            store.close()
