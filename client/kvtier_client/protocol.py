"""The rules of the hot calls that both transports (gRPC and the same-host fast lane) and both
sides share: the client checks a request with them before sending it, and the daemon
(kvtier.server.ops, .lane, .service) checks what arrives with the same functions, so the two
transports cannot answer one request differently and the client refuses what the daemon
would (docs/protocol.md).

- token ids per block (Commit): `check_token_ids` (client, before sending), `split_token_ids`
  (daemon, on receipt: the same check, then one tuple per key)
- the tiers pages are lent from (Acquire, AcquirePrefix, Prefetch): `LENT_TIERS`,
  `check_lent_tier` (client), `lent_tier` (daemon)
- the wait policy (Acquire, AcquirePrefix): `Wait`, `wait_request` (client: Wait and a
  deadline in seconds -> the proto's wait and deadline_ms), `wait_timeout` (daemon: those ->
  the core's timeout)
- grants: `Granted`, `NO_LEASE`, `read_grant` (how either transport's reply is read)
- sizes both ends hold to: `MAX_FRAME`, `LANE_BUFFER_BYTES`, `MAX_REQUEST_BYTES`,
  `PAGE_PIECE_BYTES`, `MAX_MESSAGE_BYTES`

Every check raises ValueError, saying what is wrong and what to pass instead: the client
lets it reach the engine (a request it built wrong), the daemon answers it as
INVALID_ARGUMENT on either transport (kvtier.server.ops).
"""
from __future__ import annotations

import enum
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier_client.ids import LeaseId, Slot
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.tiers import Tier
from kvtier_client.wire import tier_from_proto

# -- sizes -------------------------------------------------------------------------------
#: The largest fast-lane frame either side sends or accepts. A request that would be larger
#: goes over gRPC instead (the client decides, before sending).
MAX_FRAME = 192 << 10
#: The lane's socket buffers, at both ends: a whole MAX_FRAME frame must fit in one message.
LANE_BUFFER_BYTES = 4 * MAX_FRAME
#: The largest gRPC request of any method the daemon reads (its receive limit: gRPC refuses a
#: larger one, RESOURCE_EXHAUSTED, from its length prefix). A Lookup of 1024 keys of 64 bytes
#: is 66 KB, so this takes ~60,000 keys per call (docs/protocol.md, "Message size limits").
MAX_REQUEST_BYTES = 4 << 20
#: WritePages sends a page in pieces of this many bytes: a piece and its ids stay well under
#: MAX_REQUEST_BYTES.
PAGE_PIECE_BYTES = 1 << 20
#: The kvtier client's gRPC message limit, both ways: a ReadPages message is one whole page,
#: so the daemon sends no page larger than this over the slow path.
MAX_MESSAGE_BYTES = 256 << 20
#: deadline_ms travels as a u32 (proto uint32; the lane's u32): about 49 days.
MAX_DEADLINE_MS = (1 << 32) - 1


# -- token ids per block (Commit) --------------------------------------------------------
def check_token_ids(token_ids: Sequence[int], keys: int, block_tokens: int) -> array:
    """A commit's token ids, flat (`block_tokens` per key, in key order), as u32s: what the
    client sends and the daemon accepts. ValueError for another count, or an id that is no
    u32."""
    if len(token_ids) != keys * block_tokens:
        raise ValueError(f"commit got {len(token_ids)} token ids for {keys} keys; pass {block_tokens} per key "
                         "(each block's tokens, in key order), or none")
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        return token_ids  # the lane's decoder gives them so
    try:
        return array("I", token_ids)
    except (OverflowError, TypeError):
        raise ValueError("token ids are integers from 0 to 2**32 - 1") from None


def split_token_ids(token_ids: Sequence[int], keys: int, block_tokens: int) -> list[tuple[int, ...]]:
    """`check_token_ids`, then one tuple of token ids per key (what the store keeps on each
    block)."""
    ids = check_token_ids(token_ids, keys, block_tokens)
    return [tuple(ids[i : i + block_tokens]) for i in range(0, len(ids), block_tokens)]


# -- tiers pages are lent from -----------------------------------------------------------
#: The tiers a lease's pages can be in: host, and device on GPU daemons.
LENT_TIERS = (Tier.HOST, Tier.DEVICE)


def check_lent_tier(tier: Tier) -> None:
    """The client's check of the tier it asks pages to be lent from."""
    if tier not in LENT_TIERS:
        raise ValueError(f"pages are lent from host or device, not {tier.label}")


def lent_tier(value: int, *, has_device: bool) -> Tier:
    """A requested tier (proto numbering; unspecified is host) as the tier pages are lent
    from, on a daemon with or without a device tier."""
    if value in (pb.TIER_UNSPECIFIED, pb.TIER_HOST):
        return Tier.HOST
    if value == pb.TIER_DEVICE:
        if not has_device:
            raise ValueError("this daemon has no device tier (no GPU, or device_size 0); use TIER_HOST")
        return Tier.DEVICE
    raise ValueError(f"pages can be acquired into host (or device on GPU daemons), not tier {value}")


# -- the wait policy (Acquire, AcquirePrefix) --------------------------------------------
class Wait(enum.Enum):
    """How acquire waits for pages the daemon must first promote from a slower tier. The
    values are the proto's WaitPolicy numbers."""

    ALL = pb.WAIT_ALL  # until every page is ready
    NONE = pb.WAIT_NONE  # return the prefix that is ready now
    DEADLINE = pb.WAIT_DEADLINE  # up to the deadline, then the ready prefix


def wait_request(wait: Wait | None, deadline: float | None) -> tuple[int, int]:
    """(wait, deadline_ms) as a request carries them, from the client's `wait` (None:
    Wait.DEADLINE with a deadline, else Wait.ALL) and `deadline` in seconds (rounded up to
    whole milliseconds, at least 1)."""
    if wait is None:
        wait = Wait.DEADLINE if deadline is not None else Wait.ALL
    if (wait is Wait.DEADLINE) != (deadline is not None):
        raise ValueError("a deadline goes with wait=Wait.DEADLINE, and Wait.DEADLINE needs a deadline")
    if deadline is None:
        return wait.value, 0
    if not deadline > 0:
        raise ValueError(f"deadline must be positive seconds, got {deadline}")
    deadline_ms = max(1, math.ceil(deadline * 1000)) if math.isfinite(deadline) else MAX_DEADLINE_MS + 1
    if deadline_ms > MAX_DEADLINE_MS:
        raise ValueError(f"deadline must be at most {MAX_DEADLINE_MS // 1000} seconds, got {deadline}; "
                         "for no deadline use wait=Wait.ALL")
    return wait.value, deadline_ms


def wait_timeout(wait: int, deadline_ms: int) -> float | None:
    """A request's wait policy as the core's timeout: None = wait for all, 0 = none, t =
    seconds."""
    if wait == pb.WAIT_NONE:
        return 0.0
    if wait == pb.WAIT_DEADLINE:
        if deadline_ms == 0:
            raise ValueError("WAIT_DEADLINE needs deadline_ms > 0")
        return deadline_ms / 1000
    if wait in (pb.WAIT_ALL, pb.WAIT_POLICY_UNSPECIFIED):
        return None
    raise ValueError(f"unknown wait policy {wait}; use WAIT_NONE, WAIT_ALL or WAIT_DEADLINE")


# -- grants ------------------------------------------------------------------------------
#: The lease id no lease has (the daemon numbers leases from 1): an AcquirePrefix that found
#: nothing cached answers it on the lane; over gRPC its `lease` is unset, which reads as it.
NO_LEASE = 0


@dataclass(frozen=True)
class Granted:
    """A lease as the daemon granted it (Borrow, Acquire, AcquirePrefix)."""

    lease_id: LeaseId
    tier: Tier
    slots: tuple[Slot, ...]
    ready: int = 0  # leading pages ready to read (read leases)
    promoted: int = 0  # pages that were not ready on arrival
    ready_event: bytes = b""  # device leases: the CUDA IPC event to wait on; empty: readable now


def read_grant(lease_id: int, tier: int, slots: Sequence[int], ready: int = 0, promoted: int = 0,
               ready_event: bytes = b"") -> Granted | None:
    """A grant as either transport's reply carries it (the tier as the proto numbers it);
    None when the reply grants no lease (NO_LEASE)."""
    if lease_id == NO_LEASE:
        return None
    # Slot and LeaseId are NewTypes of int: the ints as they came are already them.
    return Granted(LeaseId(lease_id), tier_from_proto(tier), tuple(slots), ready, promoted, bytes(ready_event))
