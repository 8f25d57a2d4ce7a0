"""KV events as a client reads them from WatchEvents (docs/events.md): which blocks of which
namespace arrived in or left which tier, as the daemon publishes them to routers."""
from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from kvtier_client.errors import from_rpc_error
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.tiers import Tier
from kvtier_client.wire import tier_from_proto


class EventKind(enum.Enum):
    STORED = pb.KV_EVENT_STORED  # copies of `keys` arrived in `tier`
    REMOVED = pb.KV_EVENT_REMOVED  # copies of `keys` left `tier`
    CLEARED = pb.KV_EVENT_CLEARED  # every copy of the namespace is gone: the daemon stopped


@dataclass(frozen=True)
class KVEvent:
    """STORED: `keys` is a prefix chain in order and `parent` the key before keys[0] (None:
    a root, or not known); `token_ids` holds `block_size` ids per key when the committing
    client passed them. `ts` is when the daemon published it (unix time)."""

    kind: EventKind
    namespace: str
    tier: Tier | None
    keys: tuple[bytes, ...]
    parent: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    ts: float

    @classmethod
    def from_proto(cls, message: pb.KVEvent, ts: float) -> "KVEvent":
        return cls(
            EventKind(message.kind), message.namespace,
            tier_from_proto(message.tier) if message.tier != pb.TIER_UNSPECIFIED else None,
            tuple(message.keys), message.parent or None, tuple(message.token_ids), message.block_size, ts,
        )


class EventStream:
    """A WatchEvents call: iterate it for events; `close()` (or leaving a `with` block) ends
    it. Made once the daemon confirmed the watch: every event published after that is
    delivered, unless the daemon drops it for a reader that falls behind, which `missed`
    counts (block events; resynchronise, e.g. with Lookup, when it grows)."""

    def __init__(self, call) -> None:
        self._call = call
        self.missed = 0
        try:
            next(call)  # the daemon's first, empty response: the watch is in place
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def __iter__(self) -> Iterator[KVEvent]:
        try:
            for message in self._call:
                self.missed += message.missed
                for event in message.events:
                    yield KVEvent.from_proto(event, message.ts)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise from_rpc_error(exc) from None

    def close(self) -> None:
        self._call.cancel()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
