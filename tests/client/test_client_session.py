"""Sessions over time: heartbeats keep an idle client's leases alive past the session
timeout, while a session that stops beating is ended by the daemon."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
from client_helpers import LAYOUT, tokens
from kvtier_client import hash_fingerprint
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.proto.v1 import kvtier_pb2_grpc
from kvtier_client.wire import layout_to_proto


def test_heartbeats_keep_an_idle_session_alive(daemons, clients):
    d = daemons("--session-timeout", "1s")
    client = clients(d.target)
    pool = client.register("test/idle", LAYOUT)
    assert pool.session_timeout == 1.0 and 0 < pool.heartbeat_interval < pool.session_timeout

    # A bare session that never beats, opened alongside through the raw stub.
    channel = grpc.insecure_channel(d.target)
    stub = kvtier_pb2_grpc.KVTierStub(channel)
    silent = stub.Register(pb.RegisterRequest(
        namespace="test/idle", layout=layout_to_proto(LAYOUT), hash_algorithm="xxh3-128",
        hash_fingerprint=hash_fingerprint("xxh3-128"), client_name="silent",
    ), timeout=10)

    lease = client.borrow(2)
    time.sleep(2.5)  # well past the 1 s timeout (the daemon reaps within 1.25 timeouts)

    keys = client.block_keys(tokens(32, seed=40))
    assert lease.commit(keys).committed == 2  # the lease outlived the timeout
    assert client.reconnects == 0
    with pytest.raises(grpc.RpcError) as info:
        stub.Heartbeat(pb.HeartbeatRequest(session_id=silent.session_id), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND  # ... while the silent one was ended
    channel.close()


def test_close_stops_heartbeats_and_ends_the_session(daemons, clients):
    d = daemons("--session-timeout", "1s")
    client = clients(d.target)
    session_id = client.register("test/stop", LAYOUT).session_id
    beating = [t for t in threading.enumerate() if t.name.startswith("kvtier-heartbeat-" + session_id[:8])]
    assert len(beating) == 1
    client.close()
    assert not beating[0].is_alive()
    channel = grpc.insecure_channel(d.target)
    with pytest.raises(grpc.RpcError) as info:
        kvtier_pb2_grpc.KVTierStub(channel).Heartbeat(pb.HeartbeatRequest(session_id=session_id), timeout=10)
    channel.close()
    assert info.value.code() == grpc.StatusCode.NOT_FOUND  # CloseSession reached the daemon
