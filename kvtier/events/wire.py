"""KV events on the wire, as vLLM publishes them (docs/events.md).

vLLM's `vllm.distributed.kv_events` defines its event classes as msgspec Structs and sends
each batch msgpack-encoded. The classes are re-declared here, field for field in vLLM's
order, so that a batch kvtier publishes decodes with vLLM's own `KVEventBatch` and with the
routers that read vLLM's events; the daemon never imports vLLM.

Two layouts, because the consumers straddle a change in vLLM:

    map     an event is a msgpack map with a "type" tag (vLLM 0.28 and later: the Structs
            are not array_like). vLLM's decoder, Dynamo and SGLang-style relays read it.
    array   an event is a positional array, tag first (the layout vLLM used before, which
            llm-d's kv-cache indexer still parses: engineadapter/vllm_adapter.go).

The batch itself is `[ts, events, data_parallel_rank]` in both.

Tiers are named by kvtier_client.event_media (HBM, CPU, DISK, SHARED_STORAGE by default; the
`events_media` option renames them); the cluster tier is storage that is not on this node,
which vLLM says with `locality="REMOTE"` (its remote offload tiers do the same). Every event
says `ownership="kvtier"`: vLLM's "secondary offloading tier identifier". Block hashes are
kvtier's block keys, as bytes.
"""
from __future__ import annotations

import enum
from typing import Any

import msgspec
from kvtier_client.event_media import DEFAULT_MEDIA, OWNERSHIP
from kvtier_client.tiers import Tier

from kvtier.events.records import Event, EventKind

#: vLLM's `locality` where it is not the default (this node): the cluster is shared storage.
LOCALITY = {Tier.CLUSTER: "REMOTE"}


class EventFormat(str, enum.Enum):
    """How an event is laid out inside a batch (the module's docstring says who reads which)."""

    MAP = "map"
    ARRAY = "array"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _event_classes(array_like: bool) -> tuple[type, type, type]:
    """vLLM's BlockStored, BlockRemoved and AllBlocksCleared in one layout. The class names
    are the tags on the wire. `session_id`, after `ownership`, is left out: kvtier never
    sets it, and both layouts read a missing trailing field as None."""

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes]
        parent_block_hash: bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared


class Encoder:
    """Encodes one namespace's events as one vLLM event batch; `media`: each tier's medium
    (kvtier_client.event_media.DEFAULT_MEDIA)."""

    def __init__(self, layout: EventFormat = EventFormat.MAP, media: dict[Tier, str] | None = None) -> None:
        self.layout = EventFormat(layout)
        self.media = dict(media or DEFAULT_MEDIA)
        self._stored, self._removed, self._cleared = _event_classes(self.layout is EventFormat.ARRAY)
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, ts: float, events: list[Event]) -> bytes:
        # data_parallel_rank 0: what vLLM's publisher stamps on every batch of a rank-0 engine.
        return self._encoder.encode(EventBatch(ts, [self._struct(e) for e in events], 0))

    def _struct(self, event: Event) -> Any:
        if event.kind is EventKind.STORED:
            return self._stored(
                block_hashes=event.keys, parent_block_hash=event.parent, token_ids=event.token_ids or [],
                block_size=event.block_size, lora_id=None, medium=self.media[event.tier], lora_name=None,
                locality=LOCALITY.get(event.tier), ownership=OWNERSHIP,
            )
        if event.kind is EventKind.REMOVED:
            return self._removed(block_hashes=event.keys, medium=self.media[event.tier],
                                 locality=LOCALITY.get(event.tier), ownership=OWNERSHIP)
        return self._cleared()
