"""The daemon's KV event publisher: one thread that takes what the pools' sinks recorded,
groups it into vLLM event batches per namespace, sends them over ZMQ (kvtier.events.zmq_out:
the topics, the socket) as vLLM's publisher does, and hands the same events to the gRPC
watchers allowed to see them.

Beyond the changes, the thread tells routers the whole state (every copy held, parents
first: kvtier.core.held) when they need it, on ZMQ only:

- when a subscriber joins (its subscription reaches the XPUB socket): a router that
  started late, or restarted, or reconnected after losing messages;
- every `reannounce` seconds (0: never), for routers that lost messages silently;
- under a new engine's topic when it attaches to a namespace (a node-wide daemon), and
  taken back (BlockRemoved) from a departed engine's topic;
- a new pool's, when it opens: the pages it read from disk or adopted from the keeper;
- taken back at the daemon's stop, from every topic: its copies go with it (not
  AllBlocksCleared: routers clear a whole endpoint on it, the engine's own GPU blocks
  included, as they share the endpoint's topic). The next daemon tells what it keeps.

A repeat is told as removals, then the store (`_announce` says why): routers count stores.

Only the namespaces on the endpoint's list go out on ZMQ. Plain ZMQ has no authentication:
anyone who reaches the endpoint reads those namespaces' block keys and token ids; with
CurveZMQ (kvtier.events.curve) only the listed client keys do. WatchEvents is the
authorised way to watch one tenant's namespaces; it carries changes, not re-announces.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvtier_client.event_media import parse_media
from kvtier_client.tiers import Tier

from kvtier.events.access import AccessOptions, EndpointAccess
from kvtier.events.engines import Engines
from kvtier.events.records import Event, Record, coalesce
from kvtier.events.sink import Held, PoolEvents
from kvtier.events.topics import DaemonIdentity, EngineIdentity, Topics, parse_models
from kvtier.events.watch import Watcher, check_room
from kvtier.events.wire import Encoder, EventFormat
from kvtier.events.zmq_out import ZmqOut


class PublisherOptions(AccessOptions, Protocol):
    """The daemon's events options (kvtier.server.config.EventsConfig) as the publisher reads them."""

    endpoint: str
    topic: str
    cluster_topic: str
    format: EventFormat
    media: str
    models: str
    reannounce: float
    pod_ip: str
    engine_port: int
    node_name: str

log = logging.getLogger(__name__)

#: `events` value for WatchEvents only, no ZMQ endpoint.
WATCH_ONLY = "watch"
#: Block events a pool may have recorded and not yet published before the oldest are
#: dropped (vLLM's publisher queues 100,000 batches; ours are single blocks).
BUFFER_RECORDS = 100_000
#: WatchEvents streams at once: each holds one of the gRPC server's threads.
MAX_WATCHERS = 8
#: How often the thread looks for new subscribers when nothing else wakes it.
POLL_SECONDS = 0.2


@dataclass(frozen=True)
class EventStats:
    published: int  # block events sent over ZMQ (each block of a coalesced event counts)
    dropped: int  # block events lost before publishing: the publisher fell behind its buffer
    watchers: int  # open WatchEvents streams
    watcher_missed: int  # block events a slow watcher did not get (its queue was full)
    reannounced: int = 0  # block events sent again to tell the whole state (subscribers, engines, timer)


class EventPublisher:
    """`endpoint`: where to publish over ZMQ (None or "watch": only to WatchEvents).
    `topics`: the topics of each namespace (kvtier.events.topics). `layout` and `media`:
    how events are laid out and tiers named (kvtier.events.wire). `access`: which
    namespaces go out on the endpoint, whether it may be dialled out to, and its CURVE keys
    (by default: every namespace, bind only, plain). `reannounce`: seconds between
    re-announces of the whole state (0: only when a subscriber or an engine joins)."""

    def __init__(self, endpoint: str | None, *, topics: Topics | None = None,
                 layout: EventFormat | str = EventFormat.MAP, media: dict[Tier, str] | None = None,
                 buffer_records: int = BUFFER_RECORDS, access: EndpointAccess | None = None,
                 reannounce: float = 0.0) -> None:
        self.engines = Engines()
        self._buffer_records = buffer_records
        self._reannounce = reannounce
        self._ready = threading.Event()  # a sink has records, or an engine came or went
        self._sinks: list[PoolEvents] = []
        self._opened: list[PoolEvents] = []  # new sinks whose store's state is yet to be told
        self._out = (ZmqOut(endpoint, access or EndpointAccess(), topics or Topics(), Encoder(EventFormat(layout), media), self.engines)
                     if endpoint and endpoint != WATCH_ONLY else None)
        self._watchers: list[Watcher] = []
        self._lock = threading.Lock()  # the sinks, the watchers and the counters
        self._published = self._dropped = self._watcher_missed = self._reannounced = 0
        self._closing = False
        self._watching = True
        self._thread = threading.Thread(target=self._run, name="kvtier-events", daemon=True)
        self._thread.start()

    @classmethod
    def configured(cls, events: PublisherOptions, *, tenants: bool) -> EventPublisher:
        """The daemon's publisher, from its events options (`events.endpoint` set); `tenants`:
        namespaces are authorised by tokens (kvtier.events.access). Raises ValueError naming
        the option to fix."""
        identity = DaemonIdentity.local(events.pod_ip, events.engine_port, events.node_name)
        topics = Topics(events.topic, events.cluster_topic, identity=identity, models=parse_models(events.models))
        access = EndpointAccess.configured(events, tenants=tenants) if events.endpoint != WATCH_ONLY else EndpointAccess()
        return cls(events.endpoint, topics=topics, layout=events.format, media=parse_media(events.media),
                   access=access, reannounce=events.reannounce)

    # -- for the daemon ---------------------------------------------------------------
    def sink(self, block_size: int, held: Held | None = None) -> PoolEvents:
        """A new pool's sink (`store.events = publisher.sink(layout.block_tokens, store.held)`):
        one per store, as every call comes under that store's lock; `held` reads the
        store's whole state for re-announcing it."""
        sink = PoolEvents(block_size, self._buffer_records, self._ready, held)
        with self._lock:
            self._sinks.append(sink)
            self._opened.append(sink)  # its store's pages (read from disk, adopted) are told as state
        self._ready.set()
        return sink

    def engine_joined(self, namespace: str, engine: EngineIdentity) -> None:
        """A session of `engine` opened on `namespace` (kvtier.events.engines)."""
        self.engines.joined(namespace, engine)
        self._ready.set()

    def engine_left(self, namespace: str, engine: EngineIdentity) -> None:
        self.engines.left(namespace, engine)
        self._ready.set()

    def watch(self, visible: Callable[[str], bool], holder: str = "") -> Watcher:
        """A new WatchEvents stream's queue, fed the events of the namespaces `visible` allows;
        `holder`: whose it is (kvtier.events.watch.check_room limits each holder's streams)."""
        watcher = Watcher(visible, holder)
        with self._lock:
            if not self._watching:
                watcher.close()
            else:
                check_room(self._watchers, holder, MAX_WATCHERS)
                self._watchers.append(watcher)
        return watcher

    def end_watches(self) -> None:
        """End every WatchEvents stream, and any opened later: the daemon stops serving
        gRPC (call it before stopping the server, so it need not wait for them)."""
        with self._lock:
            self._watching = False
            watchers, self._watchers = self._watchers, []
        for watcher in watchers:
            watcher.close()

    def unwatch(self, watcher: Watcher) -> None:
        watcher.close()
        with self._lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def stats(self) -> EventStats:
        with self._lock:
            return EventStats(self._published, self._dropped, len(self._watchers), self._watcher_missed,
                              self._reannounced)

    def close(self) -> None:
        """Publish what is left, then take back every copy but the cluster's from every topic
        (the daemon stops: they go with it), end the watches, close the socket. Call it after
        the pools are closed, so their last writes are told."""
        if self._closing:
            return
        self._closing = True
        self._ready.set()
        self._thread.join()
        if self._out is not None:
            self._out.close()

    # -- the thread ---------------------------------------------------------------------
    def _take(self) -> tuple[dict[str, list[Event]], Counter[str]]:
        """Everything the sinks recorded, as each namespace's events, and what they dropped,
        by namespace."""
        records: list[Record] = []
        dropped: Counter[str] = Counter()
        for sink in self._all_sinks():
            taken, lost = sink.take()
            records += taken
            dropped += lost
        return coalesce(records), dropped

    def _all_sinks(self) -> list[PoolEvents]:
        with self._lock:
            return list(self._sinks)

    def _run(self) -> None:
        next_full = time.monotonic() + self._reannounce if self._reannounce > 0 else None
        while True:
            wait = POLL_SECONDS if self._out is not None else None
            self._ready.wait(wait)
            self._ready.clear()
            try:
                self._publish(*self._take())
                changes = self.engines.changes()
                with self._lock:
                    opened, self._opened = self._opened, []
                if self._out is not None:
                    if opened:
                        self._announce(stored=True, sinks=opened)
                    for joined, namespace, engine in changes:  # a joined engine's topic learns the namespace's state
                        self._announce(stored=joined, namespace=namespace, only=engine)
                    now = time.monotonic()
                    if self._out.subscribed() or (next_full is not None and now >= next_full):
                        self._announce(stored=True)
                        next_full = now + self._reannounce if next_full is not None else None
            except Exception:
                log.exception("KV events: a batch could not be published; continuing")
            if self._closing:
                break
        self._publish(*self._take())  # recorded while the last batch was sent
        if self._out is not None:  # the daemon's copies go with it; the next one tells what it keeps
            self._announce(stored=False)
        self.end_watches()

    def _announce(self, *, stored: bool, namespace: str | None = None, only: EngineIdentity | None = None,
                  sinks: list[PoolEvents] | None = None) -> None:
        """Tell ZMQ subscribers every copy held (`stored`), or that every copy left but the
        cluster's (they are the shared topic's). `only`: under that engine's topic alone (it
        joined or left). `sinks`: those pools' state only (new pools).

        Routers count stores: llm-d and Dynamo keep a reference count per endpoint, tier
        and block hash, add one for every BlockStored and forget a block only when as many
        BlockRemoved have come. A repeat told as a plain BlockStored would outlive the
        block's eviction. So each copy is told as two BlockRemoved, then its BlockStored:
        whatever the router counted (none, the one of the live stream, or two where a live
        store raced the reading), it ends at one. A removal of a block a router never
        counted is a no-op there. Copies without token ids are not told again: a router
        that matches by tokens learns a block only from its tokens, and would lose what
        it knew of it on the removals."""
        records: list[Record] = []
        for sink in sinks if sinks is not None else self._all_sinks():
            records += (r for r in sink.state(True, namespace) if not stored or r[5] is not None)
        gone = coalesce([(False, tier, ns, key, None, None, size) for _, tier, ns, key, _, _, size in records
                         if stored or tier is not Tier.CLUSTER])
        told = coalesce(records) if stored else {}
        ts = time.time()
        sent = 0
        for ns in dict.fromkeys([*gone, *told]):
            events = [*gone.get(ns, []), *gone.get(ns, []), *told.get(ns, [])] if stored else gone.get(ns, [])
            sent += self._out.publish(ns, ts, events, only=only, shared=only is None)
        with self._lock:
            self._reannounced += sent

    def _publish(self, batches: dict[str, list[Event]], dropped: Counter[str]) -> None:
        """Send each namespace's events over ZMQ, then hand them, and what was dropped, to
        the watchers that may see them."""
        ts = time.time()
        sent = 0
        if self._out is not None:
            sent = sum(self._out.publish(namespace, ts, events) for namespace, events in batches.items())
        with self._lock:
            watchers = list(self._watchers)
        lost = 0
        for namespace in [*batches, *(dropped.keys() - batches.keys())]:  # in the order published
            for watcher in watchers:
                if watcher.visible(namespace):
                    lost += watcher.put(batches.get(namespace, []), dropped[namespace])
        with self._lock:
            self._published += sent
            self._dropped += sum(dropped.values())
            self._watcher_missed += lost
