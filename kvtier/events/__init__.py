"""KV events: what the daemon stores, promotes, demotes and evicts, told to routers in the
format vLLM publishes (ZMQ, msgpack batches) and to WatchEvents streams (docs/events.md).

The daemon makes one publisher and hands each pool's store a sink:

    publisher = EventPublisher("tcp://*:5557", topics=Topics(...))
    pool.store.events = publisher.sink(pool.layout.block_tokens, pool.store.held)  # each new pool
    publisher.engine_joined(namespace, EngineIdentity("10.0.3.7:8000", "model"))   # at Register
    ...
    publisher.end_watches()    # before the gRPC server stops
    publisher.close()          # after the pools are closed: their last disk writes are told

The stores call the sink under their lock (kvtier.core.ports.BlockEvents); the publisher's
own thread does the rest.
"""
from kvtier.events.publisher import WATCH_ONLY, EventPublisher, EventStats
from kvtier.events.records import Event, EventKind
from kvtier.events.sink import PoolEvents
from kvtier.events.topics import (
    DEFAULT_CLUSTER_TOPIC, DEFAULT_ENGINE_PORT, DEFAULT_TOPIC, DaemonIdentity, EngineIdentity, Topics,
)
from kvtier.events.watch import Watcher
from kvtier.events.wire import LOCALITY, EventFormat

__all__ = [
    "DEFAULT_CLUSTER_TOPIC", "DEFAULT_ENGINE_PORT", "DEFAULT_TOPIC", "LOCALITY", "WATCH_ONLY", "DaemonIdentity",
    "EngineIdentity", "Event", "EventFormat", "EventKind", "EventPublisher", "EventStats", "PoolEvents", "Topics",
    "Watcher",
]
