"""Ports: what the core needs from mechanism, defined by the core and implemented there.

The core decides which page goes where; mechanism moves the bytes. The core reaches each
tier through one narrow port, by slot number, and never imports a tier. `Mechanism` holds
the ports of one store: `kvtier.mechanism.mover.arena_ports` gives real ones (arenas,
disk, cluster, device), `kvtier.core.bookkeeping.bookkeeping_ports` ones that keep only
the books (trace replay, core tests).

    host    give        a host slot is about to hold another namespace's bytes  (lock held)
            populate    fault in given slots' memory                       (lock released)
            stage / unpublish   pages in or out of the persistent slot table (lock held)
            publish     hash staged pages and enter them                   (lock released)
    disk    store / forget      host slots -> disk slots; index entries out (lock released)
    remote  present     how many leading keys the cluster holds: network    (lock released)
            write       host pages -> the cluster, `on_done` later          (asynchronous)
    disk and remote, as page sources:
            load        one page -> one host slot, `LoadJob.on_done` later  (asynchronous)
            prefetch_room / boost / cancel   the read queue's back-pressure and order
    device  give        device slots are about to hold a namespace's bytes
            promote / marker   host slots -> device slots, `on_done` when they land
            demote      device slots -> host slots                          (synchronous)

Where lower tiers encode a page (a codec: identity today), it is inside their port: the
core sees slots and records only. Asynchronous completions run on mechanism threads; the
core takes its own lock there.

`BlockEvents` is the other port: what the index tells the outside (KV events for routers)
each time a copy of a block appears in or leaves a tier.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

from kvtier_client.ids import SessionId, Slot
from kvtier_client.tiers import Tier

from kvtier.core.chunks import DiskSpace


@dataclass(frozen=True)
class PageRecord:
    """One page's persistent index entry, in the tier whose slot it names (the disk tier's
    LMDB index, the host tier's slot table). `checksum` is xxh3-64 of the page's `length`
    bytes; `seq` orders entries by write, so a restart rebuilds recency. `seal` (disk) binds
    the page to its namespace, layout and key, of kind `seal_kind` (kvtier.mechanism.seal).
    `tokens` (disk) are the block's token ids when its client gave them: KV events name them
    again after a restart, so routers that match by tokens still credit the page.
    On disk, a page is stored by codec `codec` (kvtier.codecs) in `stored` bytes (0: as it
    is, `length`), in the chunks of `extent` (kvtier.core.chunks), and `checksum` and
    `seal` are over those stored bytes."""

    namespace: str
    key: bytes
    slot: Slot
    parent: bytes | None = None
    length: int = 0
    checksum: int = 0
    seq: int = 0
    seal: bytes = b""
    seal_kind: int = 0
    tokens: tuple[int, ...] | None = None
    codec: int = 0
    stored: int = 0
    extent: tuple[int, ...] = ()


class LoadKind(IntEnum):
    """Why a disk or cluster page is loaded. Lower runs first."""

    ACQUIRE = 0
    PREFETCH = 1


@dataclass(eq=False)
class LoadJob:
    """One disk or cluster page on its way into a host slot: queued, then started, then
    done. Until started it can be cancelled (its session ended) or boosted (an Acquire now
    waits). A cluster page's `record` names no slot (-1)."""

    record: PageRecord
    host_slot: Slot
    kind: LoadKind
    session: SessionId
    on_done: Callable[["LoadJob", bool], None]
    priority: int = 0  # among prefetches: higher first
    enqueued: float = field(default_factory=time.monotonic)
    started: bool = False
    cancelled: bool = False
    source: Tier = Tier.DISK  # DISK or CLUSTER
    hold: float = 0.0  # prefetches: keep the loaded page this long (seconds; 0: the pool's prefetch_hold)


class Transfer(Protocol):
    """A host -> device copy in flight; the engine waits on it before reading the pages."""

    ipc_handle: bytes  # the interprocess CUDA event's handle, sent to the engine

    def wait(self, timeout: float | None = None) -> bool:
        """Host-side wait for the copy to land."""


class HostPort(Protocol):
    def give(self, slot: Slot, namespace: str) -> None:
        """Host slot `slot` is about to hold `namespace`'s bytes (a write lease, a load, a
        demotion), and held another namespace's (or nothing) before: nothing of the previous
        holder may show through it."""

    def populate(self, slots: Sequence[Slot], namespace: str) -> None:
        """Fault in the memory behind host slots just given to `namespace` (the lock
        released, before their writer touches them), so no request waits behind it."""

    def stage(self, records: Sequence[PageRecord]) -> list[PageRecord]:
        """Host pages whose bytes are final (committed, loaded, demoted) go into the
        persistent slot table, so that a daemon crash keeps them: those with a known
        checksum (`length` set) now, the others are returned, for `publish`."""

    def publish(self, records: Sequence[PageRecord]) -> None:
        """Hash staged pages and enter them in the slot table (the lock released: the bytes
        are read here); a page unpublished meanwhile is skipped."""

    def unpublish(self, slots: Sequence[Slot]) -> None:
        """Take host slots out of the slot table; called before they can be reused."""


class PageSource(Protocol):
    """A tier pages are read from into host slots (disk, remote)."""

    def load(self, job: LoadJob) -> None:
        """Start copying a page into `job.host_slot`; `job.on_done(job, ok)` reports the
        result, ok False if the page failed its checksum or the tier no longer holds it
        (drop it)."""

    def prefetch_room(self) -> int:
        """How many prefetch loads can be queued now (back-pressure)."""

    def boost(self, job: LoadJob) -> None:
        """Run a queued prefetch load with Acquire priority."""

    def cancel(self, session: SessionId | None, cancellable: Callable[[LoadJob], bool]) -> list[LoadJob]:
        """Withdraw a session's (None: every session's) queued loads that `cancellable`
        allows; returns them."""


class DiskPort(PageSource, Protocol):
    #: The disk's chunks as the core counts them (kvtier.core.chunks); None: a chunk per page.
    space: DiskSpace | None

    def store(self, moves: Sequence[tuple[Slot, PageRecord]]) -> list[PageRecord]:
        """Copy host slots to the disk slots named in the records; return the stored records."""

    def forget(self, records: Iterable[PageRecord]) -> None:
        """Remove disk pages from the persistent index."""


class RemotePort(PageSource, Protocol):
    def present(self, namespace: str, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the cluster tier holds (0 when it fails)."""

    def write(self, namespace: str, pages: Sequence[tuple[bytes, Slot]],
              on_done: Callable[[list[bool]], None], *, copy: bool = False) -> bool:
        """Queue host pages (key, slot) for the cluster tier; `on_done` hears each page's
        result later, on another thread. The slots must stay put until then, unless `copy`:
        their bytes are copied before this returns. False when refused (queue full, cluster
        failing): nothing was queued and `on_done` is never called."""


class DevicePort(Protocol):
    def give(self, slots: Sequence[Slot], namespace: str) -> None:
        """Device slots are about to hold `namespace`'s bytes (a promotion): nothing of a
        previous holder may show through them, in the daemon or in any client. Raises
        CapacityError, with the slots unchanged, when the device has no memory to do so."""

    def promote(self, pairs: Sequence[tuple[Slot, Slot]], on_done: Callable[[Transfer, bool], None]) -> Transfer:
        """Start copying (host slot, device slot) pairs; `on_done(transfer, ok)` when they land."""

    def marker(self) -> Transfer:
        """A transfer that completes after every promotion started so far."""

    def demote(self, pairs: Sequence[tuple[Slot, Slot]]) -> None:
        """Copy (device slot, host slot) pairs and return when the bytes are in host memory."""


@dataclass(frozen=True)
class Mechanism:
    """The ports of one store: host always; disk, remote (the cluster tier) and device
    where the pool has them (the store's tiers must match)."""

    host: HostPort
    disk: DiskPort | None = None
    remote: RemotePort | None = None
    device: DevicePort | None = None

    def source(self, tier: Tier) -> PageSource:
        """The port pages of `tier` (DISK or CLUSTER) are loaded from."""
        port = self.remote if tier is Tier.CLUSTER else self.disk
        if port is None:
            raise RuntimeError(f"no {tier.label} tier configured: the core must not load pages from it")
        return port

    def sources(self) -> list[PageSource]:
        return [port for port in (self.disk, self.remote) if port is not None]


class BlockEvents(Protocol):
    """Told of every copy that appears in a tier with its bytes in place (committed,
    loaded, promoted, demoted, written to disk, recovered) and of every such copy that
    leaves one (evicted, dropped). Called with the store's lock held: record and return,
    never block. `tokens` are the block's token ids when the client passed them at commit."""

    def stored(self, tier: Tier, namespace: str, key: bytes, parent: bytes | None,
               tokens: tuple[int, ...] | None) -> None: ...

    def removed(self, tier: Tier, namespace: str, key: bytes) -> None: ...
