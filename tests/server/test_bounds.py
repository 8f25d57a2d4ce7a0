"""What a client cannot make the daemon keep, against a real daemon: no request over 4 MiB is
read (a page larger than that travels in pieces, and its bytes arrive whole), and no more
than max_namespaces namespaces are made by clients the tokens file does not vouch for; the
bounds and the miss history's size show in Stats and the metrics."""
from __future__ import annotations

import grpc
import numpy as np
from kvtier_client import KVTierClient, PageLayout, RemotePages
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import expect_code, free_port, keys, scrape, value

REQUEST_LIMIT = 4 << 20  # kvtier_client/protocol.py MAX_REQUEST_BYTES (pinned here: the documented limit)
#: 80 layers x 8 heads x 128 x 16 tokens x K and V in float16: 5 MiB, over the request limit.
BIG = PageLayout(layers=80, kv_heads=8, head_dim=128, block_tokens=16, dtype="float16")
BIG_PB = pb.PageLayout(layers=80, kv_heads=8, head_dim=128, block_tokens=16, dtype="float16", order="page_first")


def test_a_page_larger_than_a_request_travels_in_pieces(daemons):
    daemon = daemons.start(host_size="16MiB", disk_size="0")
    assert BIG.page_bytes > REQUEST_LIMIT
    client = KVTierClient(daemon.target, map_arena=False, lane=False)
    try:
        client.register("big", BIG)
        data = [np.random.default_rng(i).integers(0, 256, BIG.page_bytes, dtype=np.uint8) for i in range(2)]
        block_keys = client.block_keys(list(range(2 * BIG.block_tokens)))
        remote = RemotePages(client)
        with client.borrow(2) as lease:
            assert remote.write_pages(lease, data) == 2
            lease.commit(block_keys)
        with client.acquire(block_keys) as lease:
            pages = remote.read_pages(lease)
        for page, payload in zip(pages, data):
            assert page.view(np.uint8).tobytes() == payload.tobytes()
    finally:
        client.close()


def test_whole_pages_over_the_limit_and_pieces_out_of_order_are_refused(daemons, connect):
    daemon = daemons.start(host_size="16MiB", disk_size="0")
    conn = connect(daemon.target, options=(("grpc.max_send_message_length", 64 << 20),))
    s = conn.session("big", layout=BIG_PB)
    lease = s.borrow(2)
    page_bytes = s.reply.page_bytes
    ids = {"session_id": s.id, "lease_id": lease.lease_id}

    def write(*messages: pb.PageData):
        return conn.call("WritePages", iter(messages), key=s.key)

    details = expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, write, pb.PageData(index=0, data=bytes(page_bytes), **ids))
    assert "larger than max" in details  # gRPC's own refusal, from the length prefix: never read
    half = page_bytes // 2
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, write, pb.PageData(index=0, data=bytes(half), **ids),
                pb.PageData(index=0, offset=half + 1, data=bytes(page_bytes - half - 1)))  # a gap
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, write, pb.PageData(index=0, data=bytes(half), **ids),
                pb.PageData(index=1, data=bytes(half)))  # page 0 left unfinished
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, write, pb.PageData(index=0, data=bytes(half), **ids),
                pb.PageData(index=0, offset=half, data=bytes(page_bytes - half + 1)))  # past the page
    done = write(pb.PageData(index=1, data=bytes(half), **ids), pb.PageData(index=1, offset=half, data=bytes(page_bytes - half)))
    assert done.pages == 1


def test_namespaces_past_max_namespaces_are_refused_unless_the_tokens_file_names_them(daemons, connect, tmp_path):
    tokens = tmp_path / "quotas.toml"
    tokens.write_text('[namespaces.listed]\nmax_host_pages = 8\n')  # auth = none: the file only sets quotas
    port = free_port()
    daemon = daemons.start("--max-namespaces", "3", "--tokens-file", str(tokens), "--auth", "none",
                           "--metrics-port", str(port))
    conn = connect(daemon.target)
    for i in range(3):
        conn.session(f"tenant-{i}")
    details = expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, conn.register, "tenant-3")
    assert "max_namespaces" in details and "tenant-3" in details
    conn.session("tenant-0")  # an admitted namespace stays admitted
    conn.session("listed")  # named by the tokens file: not counted
    state = conn.state()
    assert (state.namespaces, state.max_namespaces) == (4, 3)
    _, families = scrape(port)
    assert value(families, "kvtier_namespaces", kind="admitted") == 4
    assert value(families, "kvtier_namespaces", kind="max") == 3


def test_the_miss_history_is_bounded_in_total_and_its_size_shown(daemons, connect):
    port = free_port()
    daemon = daemons.start("--history-size", "100", "--max-namespaces", "50", "--metrics-port", str(port), disk_size="0")
    conn = connect(daemon.target)
    for i in range(40):  # 1 MiB of host holds 256 pages: each namespace's 16 evict the oldest
        conn.session(f"ns-{i}").put(keys(f"ns-{i}", 16))
    pool = conn.state().pools[0]
    assert (pool.history_entries, pool.history_limit) == (100, 100)
    assert pool.history_bytes >= 100 * 200
    _, families = scrape(port)
    assert value(families, "kvtier_history_entries", pool=pool.pool_id, kind="held") == 100
    assert value(families, "kvtier_history_bytes", pool=pool.pool_id) == pool.history_bytes
