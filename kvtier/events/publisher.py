"""The daemon's KV event publisher: one thread that takes what the pools' sinks recorded,
groups it into vLLM event batches per namespace, sends each over a ZMQ PUB socket as vLLM's
publisher does, and hands the same events to the gRPC watchers allowed to see them.

On the ZMQ socket every message is vLLM's three frames:

    topic           the topic template with {host} and {namespace} filled in, by default
                    "kv@<host>@<namespace>": the pod id and model name llm-d expects
    sequence        u64 big-endian, counting from 0 per topic, so each namespace's stream
                    reads like one vLLM engine's
    payload         the msgpack batch (kvtier.events.wire)

The endpoint is bound or connected as vLLM decides: bound when it has a wildcard ("*",
"::") or is ipc:// or inproc://, connected otherwise (llm-d's indexer binds and engines
connect to it), which the daemon does only when told (kvtier.events.access). Only the
namespaces on the endpoint's list go out on it. Plain ZMQ has no authentication: anyone who
reaches the endpoint reads those namespaces' block keys and token ids; with CurveZMQ
(kvtier.events.curve) only the listed client keys do. WatchEvents is the authorised way to
watch one tenant's namespaces.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvtier.events.access import AccessOptions, EndpointAccess, connect_refusal
from kvtier.events.curve import serve_curve
from kvtier.events.records import Event, EventKind, Record, coalesce
from kvtier.events.sink import PoolEvents
from kvtier.events.watch import Watcher, check_room
from kvtier.events.wire import Encoder, EventFormat


class PublisherOptions(AccessOptions, Protocol):
    """The daemon's events options (kvtier.server.config.EventsConfig) as the publisher reads them."""

    endpoint: str
    topic: str
    format: EventFormat

log = logging.getLogger(__name__)

DEFAULT_TOPIC = "kv@{host}@{namespace}"
#: Block events a pool may have recorded and not yet published before the oldest are
#: dropped (vLLM's publisher queues 100,000 batches; ours are single blocks).
BUFFER_RECORDS = 100_000
#: ZMQ's send high-water mark, in messages per subscriber (vLLM's default).
HWM = 100_000
#: WatchEvents streams at once: each holds one of the gRPC server's threads.
MAX_WATCHERS = 8
#: How long closing waits for the last messages to leave.
LINGER_MS = 1000


@dataclass(frozen=True)
class EventStats:
    published: int  # block events sent over ZMQ (each block of a coalesced event counts)
    dropped: int  # block events lost before publishing: the publisher fell behind its buffer
    watchers: int  # open WatchEvents streams
    watcher_missed: int  # block events a slow watcher did not get (its queue was full)


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or a local transport, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventPublisher:
    """`endpoint`: where to publish over ZMQ (None: only to WatchEvents). `topic`: the
    template of each namespace's topic ({host}, {namespace}). `layout`: how events are laid
    out in a batch (kvtier.events.wire.EventFormat). `access`: which namespaces go out on
    the endpoint, whether it may be dialled out to, and its CURVE keys (by default: every
    namespace, bind only, plain)."""

    def __init__(self, endpoint: str | None, *, topic: str = DEFAULT_TOPIC, layout: EventFormat | str = EventFormat.MAP,
                 buffer_records: int = BUFFER_RECORDS, access: EndpointAccess = EndpointAccess()) -> None:
        if endpoint and not _binds(endpoint) and not access.connect:
            raise ValueError(connect_refusal(endpoint))
        try:
            topic.format(host="h", namespace="n")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"events topic {topic!r} is not a template of {{host}} and {{namespace}} ({exc}); "
                             f"e.g. {DEFAULT_TOPIC!r}") from None
        self._topic = topic
        self._host = socket.gethostname()
        self._encoder = Encoder(EventFormat(layout))
        self._buffer_records = buffer_records
        self._access = access
        self._authenticator: ThreadAuthenticator | None = None  # CurveZMQ's ZAP handler
        self._ready = threading.Event()  # a sink has records
        self._sinks: list[PoolEvents] = []
        self._context = zmq.Context() if endpoint else None
        self._socket = self._open(endpoint) if endpoint else None
        self._topics: dict[str, bytes] = {}  # namespace -> its topic, once published on ZMQ
        self._named: dict[str, None] = {}  # every namespace with events so far, in order: each is cleared at close
        self._sequence: Counter[str] = Counter()  # namespace -> its next sequence number
        self._watchers: list[Watcher] = []
        self._lock = threading.Lock()  # the sinks, the watchers and the counters
        self._published = self._dropped = self._watcher_missed = 0
        self._closing = False
        self._watching = True
        self._thread = threading.Thread(target=self._run, name="kvtier-events", daemon=True)
        self._thread.start()

    @classmethod
    def configured(cls, events: PublisherOptions, *, tenants: bool) -> "EventPublisher":
        """The daemon's publisher, from its events options (`events.endpoint` set); `tenants`:
        namespaces are authorised by tokens (kvtier.events.access). Raises ValueError naming
        the option to fix."""
        return cls(events.endpoint, topic=events.topic, layout=events.format,
                   access=EndpointAccess.configured(events, tenants=tenants))

    def _open(self, endpoint: str) -> zmq.Socket:
        pub = self._context.socket(zmq.PUB)
        pub.set_hwm(HWM)
        pub.setsockopt(zmq.LINGER, LINGER_MS)
        try:
            if self._access.curve is not None:
                self._authenticator = serve_curve(self._context, pub, self._access.curve)
            if _binds(endpoint):
                pub.bind(endpoint)
            else:
                pub.connect(endpoint)
        except zmq.ZMQError as exc:
            self._end_socket(pub, linger=0)
            raise ValueError(f"cannot {'bind' if _binds(endpoint) else 'connect'} the KV events endpoint {endpoint!r}: "
                             f"{exc}; use e.g. tcp://*:5557 (bind) or tcp://indexer:5557 (connect)") from None
        published = "every namespace" if self._access.namespaces is None else sorted(self._access.namespaces)
        log.info("KV events: publishing on ZMQ", extra={"endpoint": endpoint, "namespaces": published,
                                                       "curve": self._access.curve is not None})
        return pub

    def _end_socket(self, pub: zmq.Socket, linger: int | None = None) -> None:
        pub.close(linger)  # by default it lingers LINGER_MS for the last messages
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    # -- for the daemon ---------------------------------------------------------------
    def sink(self, block_size: int) -> PoolEvents:
        """A new pool's sink (`store.events = publisher.sink(layout.block_tokens)`): one per
        store, as every call comes under that store's lock."""
        sink = PoolEvents(block_size, self._buffer_records, self._ready)
        with self._lock:
            self._sinks.append(sink)
        return sink

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
            return EventStats(self._published, self._dropped, len(self._watchers), self._watcher_missed)

    def close(self) -> None:
        """Publish what is left, then AllBlocksCleared to every namespace published so far
        (the daemon stops: its host and device tiers go with it), end the watches, close
        the socket. Call it after the pools are closed, so their last writes are told."""
        if self._closing:
            return
        self._closing = True
        self._ready.set()
        self._thread.join()
        if self._socket is not None:
            self._end_socket(self._socket)

    # -- the thread ---------------------------------------------------------------------
    def _take(self) -> tuple[dict[str, list[Event]], Counter[str]]:
        """Everything the sinks recorded, as each namespace's events, and what they dropped,
        by namespace."""
        with self._lock:
            sinks = list(self._sinks)
        records: list[Record] = []
        dropped: Counter[str] = Counter()
        for sink in sinks:
            taken, lost = sink.take()
            records += taken
            dropped += lost
        return coalesce(records), dropped

    def _run(self) -> None:
        while True:
            self._ready.wait()
            self._ready.clear()
            try:
                self._publish(*self._take())
            except Exception:
                log.exception("KV events: a batch could not be published; continuing")
            if self._closing:
                break
        self._publish(*self._take())  # recorded while the last batch was sent
        self._publish({ns: [Event(EventKind.CLEARED, ns, None, [])] for ns in list(self._named)}, Counter())
        self.end_watches()

    def _publish(self, batches: dict[str, list[Event]], dropped: Counter[str]) -> None:
        """Send each namespace's events over ZMQ, then hand them, and what was dropped, to
        the watchers that may see them."""
        ts = time.time()
        sent = 0
        for namespace, events in batches.items():
            self._named.setdefault(namespace)
            if self._socket is not None and self._access.publishes(namespace):
                sent += self._send(namespace, ts, events)
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

    def _send(self, namespace: str, ts: float, events: list[Event]) -> int:
        """One ZMQ message; returns the block events it carried (0 if ZMQ refused it)."""
        topic = self._topics.get(namespace)
        if topic is None:
            topic = self._topics[namespace] = self._topic.format(host=self._host, namespace=namespace).encode()
        seq = self._sequence[namespace]
        self._sequence[namespace] = seq + 1
        try:
            self._socket.send_multipart((topic, seq.to_bytes(8, "big"), self._encoder.encode(ts, events)))
        except zmq.ZMQError as exc:
            log.warning("KV events: a batch was not sent", extra={"namespace": namespace, "reason": str(exc)})
            return 0
        return sum(e.blocks for e in events)
