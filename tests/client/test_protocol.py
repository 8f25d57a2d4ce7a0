"""kvtier_client.protocol: the rules both transports and both sides share, without a daemon.
The client refuses with them before sending; the daemon answers the same ValueErrors as
INVALID_ARGUMENT (kvtier.server.ops; tests/server/test_acquire_prefix.py and
test_kv_events.py see it do so), so each message must say what is wrong and what to do."""
from __future__ import annotations

import math
from array import array

import numpy as np
import pytest
from kvtier_client import Tier, Wait, frames, protocol
from kvtier_client.errors import InvalidArgument
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.wire import tier_to_proto


# -- token ids per block -----------------------------------------------------------------
def test_token_ids_split_into_one_block_per_key():
    assert protocol.split_token_ids(list(range(6)), 2, 3) == [(0, 1, 2), (3, 4, 5)]
    assert protocol.split_token_ids(array("I", range(4)), 1, 4) == [(0, 1, 2, 3)]
    assert protocol.split_token_ids([], 0, 16) == []
    checked = protocol.check_token_ids(np.arange(32, dtype=np.int64), 2, 16)
    assert (checked.typecode, list(checked)) == ("I", list(range(32)))
    lane_ids = array("I", range(16))
    assert protocol.check_token_ids(lane_ids, 1, 16) is lane_ids  # as the lane decodes them: not copied


@pytest.mark.parametrize(("token_ids", "keys", "says"), [
    (list(range(16)), 2, "commit got 16 token ids for 2 keys; pass 16 per key (each block's tokens, in key order), or none"),
    (list(range(33)), 2, "commit got 33 token ids for 2 keys; pass 16 per key"),
    ([0] * 16, 0, "commit got 16 token ids for 0 keys; pass 16 per key"),
    ([-1] + [0] * 15, 1, "token ids are integers from 0 to 2**32 - 1"),
    ([2**32] + [0] * 15, 1, "token ids are integers from 0 to 2**32 - 1"),
    ([0.5] * 16, 1, "token ids are integers from 0 to 2**32 - 1"),
    (["a"] * 16, 1, "token ids are integers from 0 to 2**32 - 1"),
], ids=["too few", "one too many", "no keys", "negative", "2**32", "float", "str"])
def test_token_ids_split_errors(token_ids, keys, says):
    for rule in (protocol.split_token_ids, protocol.check_token_ids):  # the daemon's, and the client's
        with pytest.raises(ValueError) as refused:
            rule(token_ids, keys, 16)
        assert says in str(refused.value)
        assert not isinstance(refused.value, InvalidArgument)  # to the engine: a plain ValueError, as ever


# -- the wait policy ---------------------------------------------------------------------
def test_the_client_wait_becomes_what_the_request_carries_and_the_core_timeout():
    assert [w.value for w in Wait] == [pb.WAIT_ALL, pb.WAIT_NONE, pb.WAIT_DEADLINE]
    for wait, deadline, request, timeout in (
        (None, None, (pb.WAIT_ALL, 0), None),
        (Wait.ALL, None, (pb.WAIT_ALL, 0), None),
        (Wait.NONE, None, (pb.WAIT_NONE, 0), 0.0),
        (None, 0.25, (pb.WAIT_DEADLINE, 250), 0.25),
        (Wait.DEADLINE, 0.0001, (pb.WAIT_DEADLINE, 1), 0.001),  # rounded up: never 0 ms, which means none
        (Wait.DEADLINE, 1.0001, (pb.WAIT_DEADLINE, 1001), 1.001),
    ):
        assert protocol.wait_request(wait, deadline) == request
        assert protocol.wait_timeout(*request) == timeout
    assert protocol.wait_timeout(pb.WAIT_POLICY_UNSPECIFIED, 0) is None


@pytest.mark.parametrize(("wait", "deadline", "says"), [
    (Wait.DEADLINE, None, "Wait.DEADLINE needs a deadline"),
    (Wait.ALL, 1.0, "a deadline goes with wait=Wait.DEADLINE"),
    (Wait.DEADLINE, 0, "deadline must be positive seconds, got 0"),
    (None, -1.0, "deadline must be positive seconds, got -1.0"),
    (None, math.nan, "deadline must be positive seconds"),
    (None, 5e6, "deadline must be at most 4294967 seconds"),
    (None, math.inf, "for no deadline use wait=Wait.ALL"),
])
def test_a_wait_the_client_refuses(wait, deadline, says):
    with pytest.raises(ValueError, match=says.replace(".", r"\.").replace("*", r"\*")):
        protocol.wait_request(wait, deadline)


@pytest.mark.parametrize(("wait", "deadline_ms", "says"), [
    (pb.WAIT_DEADLINE, 0, "WAIT_DEADLINE needs deadline_ms > 0"),
    (9, 0, "unknown wait policy 9; use WAIT_NONE, WAIT_ALL or WAIT_DEADLINE"),
])
def test_a_wait_the_daemon_refuses(wait, deadline_ms, says):
    with pytest.raises(ValueError, match=says):
        protocol.wait_timeout(wait, deadline_ms)


# -- tiers pages are lent from -----------------------------------------------------------
def test_pages_are_lent_from_host_or_device():
    assert protocol.lent_tier(pb.TIER_UNSPECIFIED, has_device=False) is Tier.HOST
    assert protocol.lent_tier(pb.TIER_DEVICE, has_device=True) is Tier.DEVICE
    with pytest.raises(ValueError, match="no device tier .*; use TIER_HOST"):
        protocol.lent_tier(pb.TIER_DEVICE, has_device=False)
    protocol.check_lent_tier(Tier.DEVICE)  # the client cannot know: the daemon says
    with pytest.raises(ValueError, match="tier 9 is no kvtier.v1.Tier"):
        protocol.lent_tier(9, has_device=True)


def said(rule, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as refused:
        rule(*args, **kwargs)
    assert not isinstance(refused.value, InvalidArgument)
    return str(refused.value)


@pytest.mark.parametrize("tier", [Tier.DISK, Tier.CLUSTER])
def test_the_client_and_the_daemon_refuse_a_tier_pages_are_not_lent_from_alike(tier):
    message = said(protocol.check_lent_tier, tier)
    assert message == f"pages are lent from host or device, not {tier.label}"
    assert said(protocol.lent_tier, tier_to_proto(tier), has_device=True) == message


# -- prefetch ----------------------------------------------------------------------------
def test_a_prefetch_loads_into_host_only():
    assert protocol.PREFETCH_TIERS == (Tier.HOST,)
    assert protocol.read_prefetch(pb.TIER_UNSPECIFIED, 0, 0.0) is Tier.HOST
    assert protocol.read_prefetch(pb.TIER_HOST, -(2**31), protocol.MAX_PREFETCH_HOLD) is Tier.HOST
    protocol.check_prefetch(Tier.HOST, np.int64(5), np.float64(1.5))  # numpy numbers as engines hold them


@pytest.mark.parametrize(("tier", "priority", "hold", "says"), [
    (Tier.DEVICE, 0, 0.0, "prefetch loads pages into host, not device; an acquire into device promotes them from there"),
    (Tier.DISK, 0, 0.0, "prefetch loads pages into host, not disk"),
    (Tier.HOST, 2**31, 0.0, "a prefetch's priority is an integer from -2**31 to 2**31 - 1, got 2147483648"),
    (Tier.HOST, 1.5, 0.0, "a prefetch's priority is an integer"),
    (Tier.HOST, 0, 601.0, "a prefetch's hold (its deadline) must be 0 (the daemon's prefetch_hold) to 600 seconds, got 601.0"),
    (Tier.HOST, 0, -1.0, "a prefetch's hold (its deadline) must be 0"),
    (Tier.HOST, 0, math.nan, "a prefetch's hold (its deadline) must be 0"),
], ids=["device", "disk", "priority past int32", "priority not int", "hold too long", "hold negative", "hold nan"])
def test_the_client_and_the_daemon_refuse_a_prefetch_alike(tier, priority, hold, says):
    message = said(protocol.check_prefetch, tier, priority, hold)
    assert message.startswith(says)
    if isinstance(priority, int) and protocol.MIN_PREFETCH_PRIORITY <= priority <= protocol.MAX_PREFETCH_PRIORITY:
        # what a request can carry (an int32)
        assert said(protocol.read_prefetch, tier_to_proto(tier), priority, hold) == message


# -- cache control -----------------------------------------------------------------------
def test_a_steer_ttl_and_demote_tier_are_refused_alike_on_both_sides():
    for ttl in (-1.0, math.inf, math.nan, 8 * 24 * 3600.0):
        message = said(protocol.check_ttl, ttl)
        assert message.startswith("ttl must be 0 (until the session ends) to 604800 seconds")
        assert said(protocol.read_steer, pb.STEER_ACTION_PIN, pb.PIN_MODE_SOFT, ttl, 0, 0) == message
        assert said(protocol.Steer(protocol.Action.PIN, ttl=ttl).wire) == message
    for tier in (Tier.DEVICE, Tier.CLUSTER):
        message = said(protocol.check_demote_tier, tier)
        assert message == f"demote moves pages down to host or disk (TIER_HOST, TIER_DISK), not {tier.label}"
        assert said(protocol.read_steer, pb.STEER_ACTION_DEMOTE, 0, 0.0, 0, tier_to_proto(tier)) == message
        assert said(protocol.Steer(protocol.Action.DEMOTE, tier=tier).wire) == message
    assert protocol.read_steer(pb.STEER_ACTION_DEMOTE, 0, 0.0, 0, pb.TIER_UNSPECIFIED).tier is Tier.DISK


def test_the_daemon_answers_a_refusal_as_invalid_argument_with_the_rules_message():
    with pytest.raises(InvalidArgument) as refused:
        protocol.checked(protocol.check_prefetch, Tier.DEVICE, 0, 0.0)
    assert str(refused.value) == said(protocol.check_prefetch, Tier.DEVICE, 0, 0.0)
    assert protocol.checked(protocol.read_prefetch, pb.TIER_HOST, 0, 0.0) is Tier.HOST


# -- grants and sizes --------------------------------------------------------------------
def test_a_grant_reads_alike_from_either_transport():
    grpc_reply = pb.AcquireResponse(lease_id=7, tier=pb.TIER_HOST, slots=[3, 4], ready=2, promoted=1)
    lane_reply = frames.unpack_acquire(memoryview(frames.pack_acquire(frames.Grant(7, pb.TIER_HOST, (3, 4), 2, 1))))
    from_grpc = protocol.read_grant(grpc_reply.lease_id, grpc_reply.tier, grpc_reply.slots, grpc_reply.ready,
                                    grpc_reply.promoted, grpc_reply.ready_event)
    from_lane = protocol.read_grant(lane_reply.lease_id, lane_reply.tier, lane_reply.slots, lane_reply.ready,
                                    lane_reply.promoted, lane_reply.ready_event)
    assert from_grpc == from_lane == protocol.Granted(7, Tier.HOST, (3, 4), 2, 1, b"")
    unset = pb.AcquirePrefixResponse().lease  # AcquirePrefix over gRPC, nothing cached
    assert protocol.read_grant(unset.lease_id, unset.tier, unset.slots) is None
    assert protocol.read_grant(protocol.NO_LEASE, 0, ()) is None  # the lane's answer to the same


def test_the_limits_fit_together():
    assert frames.MAX_FRAME is protocol.MAX_FRAME
    assert protocol.LANE_BUFFER_BYTES >= protocol.MAX_FRAME
    assert protocol.PAGE_PIECE_BYTES + (1 << 10) <= protocol.MAX_REQUEST_BYTES <= protocol.MAX_MESSAGE_BYTES
