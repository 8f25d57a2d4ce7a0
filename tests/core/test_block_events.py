"""The store tells its BlockEvents sink of every copy that arrives in or leaves a tier: a
real BlockStore with the bookkeeping mover (every copy lands at once) and the daemon's own
sink (kvtier.events), read back record by record."""
from __future__ import annotations

import threading

import pytest
from kvtier_client.errors import InvalidArgument, NotFound
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.core import BlockStore
from kvtier.core.bookkeeping import BookkeepingDisk, bookkeeping_ports
from kvtier.events.records import EventKind, coalesce
from kvtier.events.sink import PoolEvents

S = "session"
NS = "tenant"
LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=8, block_tokens=4, dtype="uint8")
HOST, DISK, DEVICE = Tier.HOST, Tier.DISK, Tier.DEVICE


def tokens(i: int) -> tuple[int, ...]:
    return tuple(range(i * 4, i * 4 + 4))


class CorruptMover(BookkeepingDisk):
    """Every disk page fails its checksum when loaded."""

    def load(self, job) -> None:
        job.on_done(job, False)


def sink(capacity: int = 1000) -> PoolEvents:
    return PoolEvents(LAYOUT.block_tokens, capacity, threading.Event())


def store(host: int = 4, disk: int = 0, device: int = 0, mover=None, **kw) -> tuple[BlockStore, PoolEvents]:
    s = BlockStore(LAYOUT, host_pages=host, disk_pages=disk, device_pages=device,
                   ports=bookkeeping_ports(LAYOUT.page_bytes, disk=mover), prefetch_hold=0.0, **kw)
    s.events = sink()
    return s, s.events


def told(events: PoolEvents) -> list[tuple]:
    """What the sink recorded since the last call: ("+"/"-", tier, key, parent, tokens)."""
    records, dropped = events.take()
    assert not dropped
    assert {(namespace, block_size) for _, _, namespace, _, _, _, block_size in records} <= {(NS, LAYOUT.block_tokens)}
    return [("+" if stored else "-", tier, key, parent, tokens) for stored, tier, _, key, parent, tokens, _ in records]


def put(s: BlockStore, *keys: bytes, parent: bytes | None = None, with_tokens: bool = True) -> None:
    lease = s.borrow(S, NS, len(keys))
    s.commit(S, lease.lease_id, list(keys), parent, [t for k in keys for t in tokens(k[0])] if with_tokens else None)


def test_commit_tells_each_new_block_with_its_parent_and_tokens():
    s, events = store()
    put(s, b"\x00", b"\x01")
    put(s, b"\x02", parent=b"\x01", with_tokens=False)
    assert told(events) == [("+", HOST, b"\x00", None, tokens(0)), ("+", HOST, b"\x01", b"\x00", tokens(1)),
                            ("+", HOST, b"\x02", b"\x01", None)]
    put(s, b"\x00")  # a duplicate: no new copy anywhere
    assert told(events) == []


def test_bad_token_ids_are_refused_and_tell_nothing():
    s, events = store()
    lease = s.borrow(S, NS, 2)
    # The rule the client checks with before sending (kvtier_client.protocol.check_token_ids).
    with pytest.raises(InvalidArgument, match="commit got 4 token ids for 2 keys; pass 4 per key"):
        s.commit(S, lease.lease_id, [b"a", b"b"], None, tokens(0))
    with pytest.raises(InvalidArgument, match="token ids are integers from 0 to 2"):
        s.commit(S, lease.lease_id, [b"a", b"b"], None, [*tokens(0), -1, 1, 2, 3])
    assert told(events) == []


def test_write_through_disk_copies_keep_the_tokens():
    s, events = store(disk=4, write_through=True)
    put(s, b"\x00", b"\x01")
    assert told(events) == [("+", HOST, b"\x00", None, tokens(0)), ("+", HOST, b"\x01", b"\x00", tokens(1)),
                            ("+", DISK, b"\x00", None, tokens(0)), ("+", DISK, b"\x01", b"\x00", tokens(1))]


def test_eviction_demotes_to_disk_then_removes_from_host_and_load_tells_the_host_copy():
    s, events = store(host=2, disk=4)
    put(s, b"\x00", b"\x01")
    told(events)
    put(s, b"\x02", b"\x03", parent=b"\x01")  # host is full: both first blocks go down to disk
    assert told(events) == [
        ("+", DISK, b"\x00", None, tokens(0)), ("+", DISK, b"\x01", b"\x00", tokens(1)),
        ("-", HOST, b"\x00", None, None), ("-", HOST, b"\x01", None, None),
        ("+", HOST, b"\x02", b"\x01", tokens(2)), ("+", HOST, b"\x03", b"\x02", tokens(3)),
    ]
    grant = s.acquire(S, NS, [b"\x00"], HOST)  # room for it: \x02 goes down; \x00 told once its bytes are in host
    s.release(S, grant.lease_id)
    assert told(events) == [("+", DISK, b"\x02", b"\x01", tokens(2)), ("-", HOST, b"\x02", None, None),
                            ("+", HOST, b"\x00", None, tokens(0))]


def test_disk_eviction_and_a_corrupt_load_remove_copies():
    s, events = store(host=1, disk=1, mover=CorruptMover(LAYOUT.page_bytes))
    put(s, b"\x00")
    put(s, b"\x01")  # host full: \x00 down to disk
    told(events)
    put(s, b"\x02")  # host full: \x01 down to disk, and the disk full: \x00 evicted from it
    seen = told(events)
    assert ("-", DISK, b"\x00", None, None) in seen and ("+", DISK, b"\x01", None, tokens(1)) in seen
    with pytest.raises(NotFound):  # its disk copy fails its checksum: dropped
        s.acquire(S, NS, [b"\x01"], HOST)
    seen = told(events)
    assert ("-", DISK, b"\x01", None, None) in seen
    assert not [e for e in seen if e[0] == "+"]  # the loading host copy was never there


def test_promotion_and_device_eviction():
    s, events = store(host=4, device=1)
    put(s, b"\x00", b"\x01")
    told(events)
    s.release(S, s.acquire(S, NS, [b"\x00"], DEVICE).lease_id)
    assert told(events) == [("+", DEVICE, b"\x00", None, tokens(0))]
    s.release(S, s.acquire(S, NS, [b"\x01"], DEVICE).lease_id)  # the device holds one page: \x00 leaves it
    assert told(events) == [("-", DEVICE, b"\x00", None, None), ("+", DEVICE, b"\x01", b"\x00", tokens(1))]


def test_the_records_of_one_commit_coalesce_into_one_event_as_vllm_sends_them():
    s, events = store(disk=4, write_through=True)
    put(s, b"\x00", b"\x01", b"\x02")
    records, _ = events.take()
    events = coalesce(records)[NS]
    assert [(e.kind, e.tier, e.keys, e.parent, e.token_ids, e.block_size) for e in events] == [
        (EventKind.STORED, HOST, [b"\x00", b"\x01", b"\x02"], None, [*tokens(0), *tokens(1), *tokens(2)], 4),
        (EventKind.STORED, DISK, [b"\x00", b"\x01", b"\x02"], None, [*tokens(0), *tokens(1), *tokens(2)], 4),
    ]


def test_a_full_sink_drops_the_oldest_and_counts_them_per_namespace():
    s, _ = store()
    s.events = small = sink(capacity=2)
    put(s, b"\x00", b"\x01", b"\x02")
    records, dropped = small.take()
    assert [key for _, _, _, key, _, _, _ in records] == [b"\x01", b"\x02"] and dropped == {NS: 1}
