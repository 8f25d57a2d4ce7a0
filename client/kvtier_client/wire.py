"""Conversions between protocol messages and the client's own types.

The proto numbers tiers from 1 (0 is "unspecified", as proto3 enums require) while
kvtier_client.tiers.Tier numbers them from 0 in speed order; these tables are the one
place that knows both. The daemon can use them too.
"""
from __future__ import annotations

from kvtier_client.layout import PageLayout
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.tiers import Tier

_TO_PROTO = {Tier.DEVICE: pb.TIER_DEVICE, Tier.HOST: pb.TIER_HOST, Tier.DISK: pb.TIER_DISK, Tier.CLUSTER: pb.TIER_CLUSTER}
_FROM_PROTO = {value: tier for tier, value in _TO_PROTO.items()}


def tier_to_proto(tier: Tier) -> int:
    return _TO_PROTO[Tier(tier)]


def tier_from_proto(value: int) -> Tier:
    try:
        return _FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"tier {value} is not a known kvtier.v1.Tier; is the daemon newer than this client?") from None


#: Tier -> proto number as a bytes.translate table, and proto number -> Tier by index: the
#: fast lane sends one byte per tier, and a per-tier call would cost more than the rest.
_TO_PROTO_BYTES = bytes(_TO_PROTO.get(i, 0) for i in range(256))
_FROM_PROTO_LIST = [_FROM_PROTO.get(i) for i in range(256)]


def tiers_to_proto_bytes(tiers) -> bytes:
    """Tiers as proto numbers, one byte each."""
    return bytes(tiers).translate(_TO_PROTO_BYTES)


def tiers_from_proto_bytes(data) -> tuple[Tier, ...]:
    """The inverse; ValueError for a number that is no known tier."""
    tiers = tuple(map(_FROM_PROTO_LIST.__getitem__, data))
    if None in tiers:
        raise ValueError(f"a tier in {bytes(data)!r} is not a known kvtier.v1.Tier; is the daemon newer than this client?")
    return tiers


def layout_to_proto(layout: PageLayout) -> pb.PageLayout:
    return pb.PageLayout(
        layers=layout.layers,
        kv_heads=layout.kv_heads,
        head_dim=layout.head_dim,
        block_tokens=layout.block_tokens,
        dtype=layout.dtype,
        order=layout.order,
    )


def layout_from_proto(message: pb.PageLayout) -> PageLayout:
    """Raises ValueError (with PageLayout's message) for a malformed layout."""
    return PageLayout(
        layers=message.layers,
        kv_heads=message.kv_heads,
        head_dim=message.head_dim,
        block_tokens=message.block_tokens,
        dtype=message.dtype or "float16",
        order=message.order or "page_first",
    )
