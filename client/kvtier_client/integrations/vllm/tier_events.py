"""kvtier's tier changes of this engine's pages, relayed as vLLM KV events through vLLM's
own publisher (docs/integrations.md, "KV events through vLLM's publisher").

A router that dials each engine pod's event port (llm-d's pod discovery) learns what
kvtier holds for that pod only from that port. The commit of a page is told there already
(events.py: a BlockStored with the token ids, medium CPU). This relay follows the daemon's
WatchEvents for the connector's namespace, on a thread of its own, and turns each later
change of a page this engine stored or loaded into vLLM events under vLLM's block hashes:
a copy arriving in a tier (disk, cluster, device, or host again after an eviction) is a
BlockStored without token ids, which routers read as "this pod holds these blocks there
too"; a copy leaving one is a BlockRemoved of that tier's medium. Pages other engines
stored in a shared namespace are theirs to announce.

Each page the relay follows (kvtier key -> its KV cache group and vLLM hashes; every group's
pages have keys of their own) remembers the tiers the router was told of, so every event it sends changes what the router holds: an
entry goes when it has no tier left, and the least recently changed entry goes (its tiers
withdrawn) when there are more than `max_pages` (about 260 bytes a page of one block). An
event that finds the queue full is dropped and counted, and what it would have said is not
recorded either.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvtier_client.errors import FailedPrecondition, KVTierError
from kvtier_client.event_media import DEFAULT_MEDIA, OWNERSHIP
from kvtier_client.events import EventKind, KVEvent
from kvtier_client.integrations.vllm.events import page_hashes
from kvtier_client.integrations.vllm.link import log
from kvtier_client.keys import BlockKey
from kvtier_client.tiers import Tier

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import ExternalBlockHash
    from vllm.v1.request import Request

    from kvtier_client.client import KVTierClient
    from kvtier_client.integrations.vllm.events import BlockPayload
    from kvtier_client.integrations.vllm.kv_groups import KVGroup

#: vLLM events waiting for vLLM's `take_events` (it takes them every engine step).
MAX_QUEUED_EVENTS = 100_000
#: Daemon events about pages whose save is still being committed, kept until it is.
MAX_HELD_EVENTS = 10_000
#: Pages withdrawn per event, and per hold of the lock, when the daemon went away.
WITHDRAW_CHUNK = 4096
#: Seconds between attempts to watch again after the daemon went away, doubling up to the last.
RETRY_FIRST, RETRY_MOST = 0.25, 10.0
#: The tiers a daemon takes with it when it stops: disk and cluster copies outlive it.
_GONE_WITH_DAEMON = (Tier.DEVICE, Tier.HOST)
#: A followed page, as compact as it can be (a million of them are kept): the tiers the
#: router was told of (a bit per tier, `1 << tier`), its group's index in `groups`, then the
#: page's vLLM block hashes.
Followed = tuple
_HASHES = 2  # where a Followed's hashes start
#: vLLM's `locality`: the cluster tier is storage shared by nodes, the others this node's.
_LOCALITY = {Tier.CLUSTER: "REMOTE"}


def tiers_of(page: Followed) -> list[Tier]:
    return [tier for tier in Tier if page[0] >> tier & 1]


def stored_event(hashes: list[ExternalBlockHash], tier: Tier, block_size: int, group: KVGroup) -> BlockStored:
    """A location update: these known blocks of `group` are also in `tier` (no token ids)."""
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=block_size,
                       lora_id=None, medium=DEFAULT_MEDIA[tier], lora_name=None, group_idx=group.index,
                       kv_cache_spec_kind=group.spec_kind or None, kv_cache_spec_sliding_window=group.spec_window,
                       locality=_LOCALITY.get(tier, "LOCAL"), ownership=OWNERSHIP)


def removed_event(hashes: list[ExternalBlockHash], tier: Tier, group: KVGroup) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=DEFAULT_MEDIA[tier], group_idx=group.index,
                        locality=_LOCALITY.get(tier, "LOCAL"), ownership=OWNERSHIP)


class TierEvents:
    """The relay (module docstring). `client`: its own connection to the daemon (no session:
    it only watches), closed with the relay; `groups`: the engine's KV cache groups;
    `block_size`, `per_page`: vLLM's block and how many of them a kvtier page holds;
    `hash_block_size`: the granularity of vLLM's request hashes; `max_pages`: pages followed
    at most."""

    def __init__(self, client: KVTierClient, namespace: str, groups: Sequence[KVGroup], *, block_size: int,
                 per_page: int, hash_block_size: int, max_pages: int, max_queued: int = MAX_QUEUED_EVENTS) -> None:
        self._client, self._namespace, self._groups = client, namespace, tuple(groups)
        self._block_size, self._per_page, self._hash_block_size = block_size, per_page, hash_block_size
        self._max_pages, self._max_queued = max_pages, max_queued
        self._pages: OrderedDict[BlockKey, Followed] = OrderedDict()  # least recently changed first
        self._pending: dict[BlockKey, int] = {}  # keys of saves being committed -> how many saves
        self._held: list[KVEvent] = []  # daemon events naming pending keys
        self._queue: list[KVCacheEvent] = []
        self._dropped = 0  # vLLM events dropped: the queue was full
        self._lock = threading.Lock()  # everything above; held for short bookkeeping only
        self._stop = threading.Event()
        self._stream = None  # the watch in progress, to cancel on close
        self._thread = threading.Thread(target=self._run, name="kvtier-tier-events", daemon=True)
        self._thread.start()

    # -- the scheduler's side ------------------------------------------------------
    def expect(self, keys: Iterable[BlockKey]) -> None:
        """A save of these pages was sent: hold the daemon's events about them until its
        commit says which were new (write-through writes them to disk before it returns)."""
        with self._lock:
            for key in keys:
                self._pending[key] = self._pending.get(key, 0) + 1

    def committed(self, group: int, keys: list[BlockKey], new: tuple[int, ...] | None, payload: BlockPayload) -> None:
        """A save of pages of group `group` (its index) ended: `new`, the indices of the keys
        the daemon took (None: none). Queues their BlockStored (with the token ids, medium
        CPU), follows them from now on, and applies what the daemon said of them meanwhile."""
        with self._lock:
            for key in keys:
                if (count := self._pending.pop(key, 0)) > 1:
                    self._pending[key] = count - 1
            if new:
                blocks = tuple(p * self._per_page + j for p in new for j in range(self._per_page))
                if self._put(payload.events(blocks, self._block_size, self._groups[group])):
                    for p in new:
                        self._follow(keys[p], group, payload.page_hashes(p, self._per_page), 1 << Tier.HOST)
            held, self._held = self._held, []
            for event in held:
                self._apply(event)

    def loaded(self, request: Request, group: int, keys: list[BlockKey], start: int, end: int) -> None:
        """This engine loads pages [start, end) of group `group` of `request` (`keys`: the
        group's page keys; vLLM announces its own copies of them): follow them too."""
        hashes = page_hashes(request, start, end, self._per_page, self._block_size, self._hash_block_size)
        with self._lock:
            for key, blocks in zip(keys[start:end], hashes or ()):
                if key in self._pages:
                    self._pages.move_to_end(key)
                else:
                    self._follow(key, group, blocks, 0)

    def take(self) -> list[KVCacheEvent]:
        """The events for vLLM's publisher, oldest first."""
        with self._lock:
            events, self._queue = self._queue, []
        return events

    @property
    def watching(self) -> bool:
        """Whether a watch of the daemon's events is in place now."""
        return self._stream is not None

    @property
    def followed(self) -> int:
        """Pages followed now."""
        return len(self._pages)

    def take_dropped(self) -> int:
        with self._lock:
            dropped, self._dropped = self._dropped, 0
        return dropped

    def forget(self) -> None:
        """vLLM reset its cache (and published AllBlocksCleared): the router forgot this
        engine's blocks, and pages from before are not read again. Follow none of them."""
        with self._lock:
            self._pages.clear()
            self._held.clear()
            self._queue.clear()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.close()
        self._client.close()  # also ends a watch being set up
        self._thread.join(timeout=10)

    # -- bookkeeping (under the lock) ------------------------------------------------
    def _put(self, events: list[KVCacheEvent]) -> bool:
        if len(self._queue) + len(events) > self._max_queued:
            self._dropped += len(events)
            return False
        self._queue.extend(events)
        return True

    def _follow(self, key: BlockKey, group: int, hashes: tuple[ExternalBlockHash, ...], tiers: int) -> None:
        if (old := self._pages.get(key)) is not None:
            tiers |= old[0]  # never forget a tier the router was told of: only a removal takes it back
        self._pages[key] = (tiers, group, *hashes)
        self._pages.move_to_end(key)
        while len(self._pages) > self._max_pages:  # withdraw what can no longer be followed
            _, oldest = self._pages.popitem(last=False)
            self._put([removed_event(list(oldest[_HASHES:]), tier, self._groups[oldest[1]])
                       for tier in tiers_of(oldest)])

    def _by_group(self, keys: list[BlockKey]) -> dict[int, list[ExternalBlockHash]]:
        """The vLLM hashes of these followed pages, by group index (one vLLM event each)."""
        hashes: dict[int, list[ExternalBlockHash]] = {}
        for key in keys:
            page = self._pages[key]
            hashes.setdefault(page[1], []).extend(page[_HASHES:])
        return hashes

    def _apply(self, event: KVEvent) -> None:
        """One daemon event: what it changes of the pages followed, as one vLLM event."""
        if event.tier is None:
            return
        stored, bit = event.kind is EventKind.STORED, 1 << event.tier
        changed: list[BlockKey] = []
        hold = False
        for key in event.keys:
            page = self._pages.get(key)
            if page is None:
                hold = hold or key in self._pending
            elif bool(page[0] & bit) != stored:
                changed.append(key)
        if hold and len(self._held) < MAX_HELD_EVENTS:
            self._held.append(event)  # applied again once those saves end (what is applied now is then no change)
        if changed:
            groups = self._groups
            events = [stored_event(hashes, event.tier, self._block_size, groups[g]) if stored
                      else removed_event(hashes, event.tier, groups[g]) for g, hashes in self._by_group(changed).items()]
            if self._put(events):  # else the router is not told, nor the book
                self._mark(changed, bit, stored)

    def _mark(self, keys: list[BlockKey], bit: int, present: bool) -> None:
        """The router was told these pages are (or are no longer) in the tier of `bit`."""
        for key in keys:
            page = self._pages[key]
            tiers = page[0] | bit if present else page[0] & ~bit
            if tiers:
                self._pages[key] = (tiers, *page[1:])
                self._pages.move_to_end(key)
            else:
                del self._pages[key]

    def _daemon_gone(self) -> None:
        """The daemon stopped (AllBlocksCleared), or the watch broke and what happened
        meanwhile is unknown: withdraw the host and device copies, which go with a daemon (a
        warm restart that kept them tells of them again), and keep the disk and cluster ones.
        A chunk of pages per hold of the lock: the scheduler never waits long."""
        with self._lock:
            keys = list(self._pages)
        for start in range(0, len(keys), WITHDRAW_CHUNK):
            with self._lock:
                chunk = [k for k in keys[start : start + WITHDRAW_CHUNK] if k in self._pages]
                for tier in _GONE_WITH_DAEMON:
                    bit = 1 << tier
                    held = [k for k in chunk if self._pages[k][0] & bit]
                    if held and self._put([removed_event(hashes, tier, self._groups[g])
                                           for g, hashes in self._by_group(held).items()]):
                        self._mark(held, bit, False)
                        chunk = [k for k in chunk if k in self._pages]

    # -- the watching thread ---------------------------------------------------------
    def _run(self) -> None:
        """Watch the namespace's events until closed; watch again (with backoff) whenever
        the daemon goes away, as it does when it restarts."""
        delay, complained = RETRY_FIRST, False
        while not self._stop.is_set():
            try:
                stream = self._client.watch_events([self._namespace])
            except KVTierError as exc:
                if not complained:
                    hint = " (it runs without --events)" if isinstance(exc, FailedPrecondition) else ""
                    log.warning("kvtier connector: cannot watch the daemon's KV events%s; kvtier's disk and "
                                "eviction changes are not published until it can: %s", hint, exc)
                    complained = True
            else:
                if complained:
                    log.info("kvtier connector: watching the daemon's KV events again")
                delay, complained = RETRY_FIRST, False
                self._follow_stream(stream)
            self._stop.wait(delay)
            delay = min(2 * delay, RETRY_MOST)

    def _follow_stream(self, stream) -> None:
        missed = 0
        with self._lock:
            self._stream = stream
        try:
            if self._stop.is_set():
                return
            for event in stream:
                if event.namespace != self._namespace:
                    continue
                if event.kind is EventKind.CLEARED:
                    self._daemon_gone()
                else:
                    with self._lock:
                        self._apply(event)
                if stream.missed and not missed:
                    missed = stream.missed
                    log.warning("kvtier connector: the daemon dropped %d KV events for this engine's relay (it fell "
                                "behind); routers may credit pages that have moved", missed)
        except KVTierError as exc:
            if not self._stop.is_set():
                log.info("kvtier connector: the daemon's KV event stream broke (%s); watching again", exc)
        finally:
            with self._lock:
                self._stream = None
            stream.close()
            if not self._stop.is_set():
                self._daemon_gone()
