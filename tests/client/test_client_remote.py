"""The slow path: a client that maps nothing streams page bytes over gRPC (WritePages /
ReadPages) and sees exactly the bytes a shared-memory client sees."""
from __future__ import annotations

import numpy as np
import pytest
from client_helpers import LAYOUT, as_bytes, kv_pages, tokens
from kvtier_client import KVTierError, PageLayout, RemotePages


def test_remote_write_is_read_in_place_and_remote_read_matches(daemon, clients, namespace):
    remote_client = clients(daemon.target, map_arena=False, name="remote engine")
    local = clients(daemon.target, name="local engine")
    remote_client.register(namespace, LAYOUT)
    local.register(namespace, LAYOUT)
    remote = RemotePages(remote_client)
    keys = remote_client.block_keys(tokens(80, seed=20))
    data = kv_pages(len(keys), LAYOUT, seed=20)

    # Remote writer: pages as float16 arrays, streamed, then committed.
    arrays = [d.view(np.float16).reshape(LAYOUT.shape) for d in data]
    with remote_client.borrow(len(keys)) as lease:
        with pytest.raises(KVTierError, match="map_arena=False"):
            lease.pages  # nothing is mapped in a remote client
        assert remote.write_pages(lease, arrays) == len(keys)
        assert lease.commit(keys).committed == len(keys)

    # A same-host reader sees those bytes in place.
    with local.acquire(keys) as lease:
        for page, payload in zip(lease.pages, data):
            np.testing.assert_array_equal(as_bytes(page), payload)

    # The remote reader gets the same bytes, shaped like the in-place views.
    with remote_client.acquire(keys) as lease:
        pages = remote.read_pages(lease)
    assert len(pages) == len(keys)
    for page, payload in zip(pages, data):
        assert page.shape == LAYOUT.shape and page.dtype == np.float16
        np.testing.assert_array_equal(as_bytes(page), payload)


def test_remote_read_of_pages_written_in_place(daemon, clients, namespace):
    local = clients(daemon.target)
    remote_client = clients(daemon.target, map_arena=False)
    layout = PageLayout(layers=3, kv_heads=1, head_dim=24, block_tokens=8, dtype="bfloat16")  # page not slot-sized
    local.register(namespace, layout)
    remote_client.register(namespace, layout)
    keys = local.block_keys(tokens(24, seed=21))
    data = kv_pages(len(keys), layout, seed=21)
    with local.borrow(len(keys)) as lease:
        for page, payload in zip(lease.pages, data):
            as_bytes(page)[:] = payload
        lease.commit(keys)
    with remote_client.acquire(keys) as lease:
        pages = RemotePages(remote_client).read_pages(lease)
    assert [p.dtype for p in pages] == [np.dtype(np.uint16)] * len(keys)  # bfloat16 bits, as in place
    for page, payload in zip(pages, data):
        np.testing.assert_array_equal(as_bytes(page), payload)


def test_remote_torch_and_bytes_pages(daemon, clients, namespace):
    torch = pytest.importorskip("torch")
    layout = PageLayout(layers=2, kv_heads=2, head_dim=16, block_tokens=16, dtype="bfloat16")
    client = clients(daemon.target, map_arena=False)
    client.register(namespace, layout)
    remote = RemotePages(client)
    keys = client.block_keys(tokens(32, seed=22))
    tensor = torch.randn(*layout.shape, generator=torch.Generator().manual_seed(22)).to(torch.bfloat16)
    raw = kv_pages(1, layout, seed=23)[0].tobytes()
    with client.borrow(2) as lease:
        remote.write_pages(lease, [tensor, raw])
        lease.commit(keys)
    with client.acquire(keys) as lease:
        first, second = remote.read_pages(lease)
    assert torch.equal(torch.from_numpy(first.view(np.int16)).view(torch.bfloat16), tensor)
    assert second.tobytes() == raw


def test_remote_write_checks_sizes_before_sending(daemon, clients, namespace):
    client = clients(daemon.target, map_arena=False)
    client.register(namespace, LAYOUT)
    remote = RemotePages(client)
    with client.borrow(1) as lease:
        with pytest.raises(ValueError, match="page_bytes"):
            remote.write_pages(lease, [b"short"])
        with pytest.raises(ValueError, match="1 to 1 pages"):
            remote.write_pages(lease, [bytes(LAYOUT.page_bytes)] * 2)
