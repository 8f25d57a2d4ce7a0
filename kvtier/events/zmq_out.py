"""The ZMQ side of KV events: the socket, which topic each event goes out under, and who
subscribed (docs/events.md, "On the wire").

Every message is vLLM's three frames: the topic, a u64 big-endian sequence counting from 0
per topic (each topic reads like one vLLM engine's stream), and one msgpack batch. A
namespace's events go out under the topic of every engine attached to it, its cluster-tier
events once under the shared topic (kvtier.events.topics). Large batches (a re-announce of
the whole state) are cut into messages of at most `MESSAGE_BLOCKS` block events.

The socket is an XPUB: it sends as a PUB does, and hears each subscription, so a router that
connects (or reconnects) is answered with the whole state instead of waiting for changes.
It is bound or connected as vLLM decides: bound when the endpoint has a wildcard ("*",
"::") or is ipc:// or inproc://, connected otherwise, which the daemon does only when told
(kvtier.events.access).
"""
from __future__ import annotations

import logging

import zmq
from kvtier_client.tiers import Tier
from zmq.auth.thread import ThreadAuthenticator

from kvtier.events.access import EndpointAccess, connect_refusal
from kvtier.events.curve import serve_curve
from kvtier.events.engines import Engines
from kvtier.events.records import Event
from kvtier.events.topics import EngineIdentity, Topics
from kvtier.events.wire import Encoder

log = logging.getLogger(__name__)

#: ZMQ's send high-water mark, in messages per subscriber (vLLM's default).
HWM = 100_000
#: How long closing waits for the last messages to leave.
LINGER_MS = 1000
#: Block events per message at most: a re-announce of a large cache goes out in pieces a
#: router decodes without holding tens of megabytes at once.
MESSAGE_BLOCKS = 8192


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or a local transport, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqOut:
    """One XPUB socket. Used by the publisher's thread only (ZMQ sockets are not thread-safe)."""

    def __init__(self, endpoint: str, access: EndpointAccess, topics: Topics, encoder: Encoder,
                 engines: Engines) -> None:
        if not binds(endpoint) and not access.connect:
            raise ValueError(connect_refusal(endpoint))
        self.access = access
        self.topics = topics
        self.engines = engines
        self._encoder = encoder
        self._sequence: dict[bytes, int] = {}
        self._authenticator: ThreadAuthenticator | None = None  # CurveZMQ's ZAP handler
        self._context = zmq.Context()
        self._socket = self._open(endpoint)

    def _open(self, endpoint: str) -> zmq.Socket:
        pub = self._context.socket(zmq.XPUB)
        pub.set_hwm(HWM)
        pub.setsockopt(zmq.LINGER, LINGER_MS)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only a topic's first
        try:
            if self.access.curve is not None:
                self._authenticator = serve_curve(self._context, pub, self.access.curve)
            if binds(endpoint):
                pub.bind(endpoint)
            else:
                pub.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close(linger=0, sock=pub)
            raise ValueError(f"cannot {'bind' if binds(endpoint) else 'connect'} the KV events endpoint {endpoint!r}: "
                             f"{exc}; use e.g. tcp://*:5557 (bind) or tcp://indexer:5557 (connect)") from None
        published = "every namespace" if self.access.namespaces is None else sorted(self.access.namespaces)
        log.info("KV events: publishing on ZMQ", extra={"endpoint": endpoint, "namespaces": published,
                                                       "curve": self.access.curve is not None})
        return pub

    def subscribed(self) -> bool:
        """Whether a subscriber joined since the last call (its subscription arrived)."""
        joined = False
        while self._socket.poll(0):
            message = self._socket.recv()
            joined = joined or message[:1] == b"\x01"
        return joined

    def publish(self, namespace: str, ts: float, events: list[Event], *, only: EngineIdentity | None = None,
                shared: bool = True) -> int:
        """Send a namespace's events under its engines' topics (`only`: that engine's), and
        its cluster events under the shared topic (unless `shared` is False). Returns the
        block events sent, counted once however many topics carry them."""
        if not self.access.publishes(namespace):
            return 0
        engines = self.engines.of(namespace)
        local = [e for e in events if e.tier is not Tier.CLUSTER]
        cluster = [e for e in events if e.tier is Tier.CLUSTER]
        sent = 0
        if local:
            targets = [only] if only is not None else (engines or [None])
            results = [self._send(self.topics.engine(namespace, engine, engines), ts, local) for engine in targets]
            sent += max(results)
        if cluster and shared:
            sent += self._send(self.topics.shared(namespace, engines), ts, cluster)
        return sent

    def _send(self, topic: bytes, ts: float, events: list[Event]) -> int:
        sent = 0
        for piece in _pieces(events):
            seq = self._sequence.get(topic, 0)
            self._sequence[topic] = seq + 1
            try:
                self._socket.send_multipart((topic, seq.to_bytes(8, "big"), self._encoder.encode(ts, piece)))
            except zmq.ZMQError as exc:
                log.warning("KV events: a batch was not sent", extra={"topic": topic.decode(errors="replace"),
                                                                     "reason": str(exc)})
                continue
            sent += sum(e.blocks for e in piece)
        return sent

    def close(self, linger: int | None = None, sock: zmq.Socket | None = None) -> None:
        (sock or self._socket).close(linger)  # by default it lingers LINGER_MS for the last messages
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()


def _pieces(events: list[Event]) -> list[list[Event]]:
    """The events cut into messages of at most MESSAGE_BLOCKS block events (an event with
    more is cut too: its later part's parent is the earlier part's last key)."""
    pieces: list[list[Event]] = [[]]
    room = MESSAGE_BLOCKS
    for event in events:
        while event.blocks > room:
            head, event = _split(event, room)
            pieces[-1].append(head)
            pieces.append([])
            room = MESSAGE_BLOCKS
        pieces[-1].append(event)
        room -= event.blocks
        if room == 0:
            pieces.append([])
            room = MESSAGE_BLOCKS
    return [p for p in pieces if p]


def _split(event: Event, n: int) -> tuple[Event, Event]:
    size = event.block_size
    tokens = event.token_ids
    head = Event(event.kind, event.namespace, event.tier, event.keys[:n], event.parent,
                 tokens[:n * size] if tokens is not None else None, size)
    tail = Event(event.kind, event.namespace, event.tier, event.keys[n:], event.keys[n - 1],
                 tokens[n * size:] if tokens is not None else None, size)
    return head, tail
