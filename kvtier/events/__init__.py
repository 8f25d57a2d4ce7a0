"""KV events: what the daemon stores, promotes, demotes and evicts, told to routers in the
format vLLM publishes (ZMQ PUB, msgpack batches) and to WatchEvents streams (docs/events.md).

The daemon makes one publisher and hands each pool's store a sink:

    publisher = EventPublisher("tcp://*:5557")
    pool.store.events = publisher.sink(pool.layout.block_tokens)     # each new pool
    ...
    publisher.end_watches()    # before the gRPC server stops
    publisher.close()          # after the pools are closed: their last disk writes are told

The stores call the sink under their lock (kvtier.core.ports.BlockEvents); the publisher's
own thread does the rest.
"""
from kvtier.events.publisher import DEFAULT_TOPIC, EventPublisher, EventStats
from kvtier.events.records import Event, EventKind
from kvtier.events.sink import PoolEvents
from kvtier.events.watch import Watcher
from kvtier.events.wire import LOCALITY, MEDIUM, EventFormat

__all__ = [
    "DEFAULT_TOPIC", "LOCALITY", "MEDIUM", "Event", "EventFormat", "EventKind", "EventPublisher", "EventStats",
    "PoolEvents", "Watcher",
]
