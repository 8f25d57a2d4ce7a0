"""The rules of the hot calls that both transports (gRPC and the same-host fast lane) and both
sides share: the client checks a request with them before sending it, and the daemon
(kvtier.server.ops, .lane, .service) checks what arrives with the same functions, so the two
transports cannot answer one request differently and the client refuses what the daemon
would (docs/protocol.md).

- token ids per block (Commit): `check_token_ids` (client, before sending), `split_token_ids`
  (the daemon's core, on receipt: the same check, then one tuple per key)
- the engine's own blocks (Lookup, LookupGroups): `check_known`
- the tiers pages are lent from (Acquire, AcquirePrefix): `LENT_TIERS`, `check_lent_tier`
  (client, and the core with what tiers it has), `lent_tier` (daemon: the proto's number)
- a prefetch (Prefetch): `PREFETCH_TIERS`, its priority and hold (the engine's deadline):
  `check_prefetch` (client, and the core), `read_prefetch` (daemon)
- the wait policy (Acquire, AcquirePrefix): `Wait`, `wait_request` (client: Wait and a
  deadline in seconds -> the proto's wait and deadline_ms), `wait_timeout` (daemon: those ->
  the core's timeout)
- grants: `Granted`, `NO_LEASE`, `read_grant` (how either transport's reply is read)
- cache control (Steer): `Steer` (a request but its keys), `Steer.wire` (client: its proto
  numbers, checked), `read_steer` (daemon: those numbers -> a Steer); the ttl of a pin or
  retain, `check_ttl`, and the tiers a demote moves pages to, `DEMOTE_TIERS` and
  `check_demote_tier`, which the core applies too
- sizes both ends hold to: `MAX_FRAME`, `LANE_BUFFER_BYTES`, `MAX_REQUEST_BYTES`,
  `PAGE_PIECE_BYTES`, `MAX_MESSAGE_BYTES`

Every check raises ValueError, saying what is wrong and what to pass instead: the client
lets it reach the engine (a request it built wrong); the daemon applies it through `checked`,
which makes it InvalidArgument, answered as INVALID_ARGUMENT on either transport. These
are the only statements of these rules: the daemon's core calls the same functions where
it checks a request (with what only it knows, such as whether it has a device tier).
"""
from __future__ import annotations

import enum
import math
import numbers
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvtier_client.errors import InvalidArgument
from kvtier_client.ids import LeaseId, Slot
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.steering import MAX_PREFETCH_HOLD, MAX_TTL_SECONDS, Action, PinMode, Priority
from kvtier_client.tiers import Tier
from kvtier_client.wire import tier_from_proto, tier_to_proto

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

T = TypeVar("T")


def checked(rule: Callable[..., T], *args, **kwargs) -> T:
    """A rule applied by the daemon to a request it received (kvtier.server.ops, and the
    core where it checks one): what the rule refuses is InvalidArgument, with the rule's
    message, which either transport answers as INVALID_ARGUMENT."""
    try:
        return rule(*args, **kwargs)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def _tier(value: int, unset: Tier) -> Tier:
    """A tier as a request numbers it (kvtier.v1.Tier; TIER_UNSPECIFIED reads as `unset`), so
    that the daemon's rule then names it as the client's does."""
    if value == pb.TIER_UNSPECIFIED:
        return unset
    try:
        return tier_from_proto(value)
    except ValueError:
        raise ValueError(f"tier {value} is no kvtier.v1.Tier; use TIER_HOST, TIER_DEVICE or TIER_DISK") from None


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


# -- the engine's own blocks (Lookup, LookupGroups) --------------------------------------
def check_known(known: int, keys: int) -> int:
    """`known`, the leading blocks of a lookup the engine holds already (counted apart from
    kvtier's hits: docs/metrics.md), checked against the `keys` it looks up."""
    if not isinstance(known, int) or not 0 <= known <= keys:
        raise ValueError(f"a lookup's known blocks (those the engine holds already) are 0 to its {keys} keys, "
                         f"got {known!r}; pass how many leading keys the engine has, at most all of them")
    return known


# -- tiers pages are lent from -----------------------------------------------------------
#: The tiers a lease's pages can be in: host, and device on GPU daemons.
LENT_TIERS = (Tier.HOST, Tier.DEVICE)


def check_lent_tier(tier: Tier, *, has_device: bool = True) -> None:
    """The tier pages are to be lent from, on a daemon with or without a device tier (the
    client, which cannot know, checks the rest)."""
    tier = Tier(tier)
    if tier not in LENT_TIERS:
        raise ValueError(f"pages are lent from host or device, not {tier.label}")
    if tier is Tier.DEVICE and not has_device:
        raise ValueError("this daemon has no device tier (no GPU, or device_size 0); use TIER_HOST")


def lent_tier(value: int, *, has_device: bool) -> Tier:
    """A requested tier (proto numbering; unspecified is host), checked as `check_lent_tier`."""
    tier = _tier(value, Tier.HOST)
    check_lent_tier(tier, has_device=has_device)
    return tier


# -- prefetch ----------------------------------------------------------------------------
#: The tiers a prefetch loads pages into: host only (an acquire into device promotes them
#: from there).
PREFETCH_TIERS = (Tier.HOST,)
#: A prefetch's priority travels as an int32 (PrefetchRequest.priority; the lane's i32).
MIN_PREFETCH_PRIORITY, MAX_PREFETCH_PRIORITY = -(1 << 31), (1 << 31) - 1


def check_prefetch(tier: Tier, priority: int, hold: float) -> None:
    """A prefetch's tier, priority (its place among queued prefetches) and hold (the
    engine's deadline, seconds: its pages are held in host until then; 0: the daemon's
    prefetch_hold)."""
    tier = Tier(tier)
    if tier not in PREFETCH_TIERS:
        raise ValueError(f"prefetch loads pages into host, not {tier.label}; an acquire into device "
                         "promotes them from there")
    if (isinstance(priority, bool) or not isinstance(priority, numbers.Integral)
            or not MIN_PREFETCH_PRIORITY <= priority <= MAX_PREFETCH_PRIORITY):
        raise ValueError(f"a prefetch's priority is an integer from -2**31 to 2**31 - 1, got {priority!r}")
    if isinstance(hold, bool) or not isinstance(hold, (int, float)) or not 0 <= hold <= MAX_PREFETCH_HOLD:
        raise ValueError(f"a prefetch's hold (its deadline) must be 0 (the daemon's prefetch_hold) to "
                         f"{MAX_PREFETCH_HOLD:.0f} seconds, got {hold!r}; a longer wait is a pin's")


def read_prefetch(tier: int, priority: int, hold: float) -> Tier:
    """A Prefetch request's numbers (PrefetchRequest, the lane's PREFETCH frame; tier
    unspecified is host), checked as `check_prefetch`: the tier to load into."""
    requested = _tier(tier, Tier.HOST)
    check_prefetch(requested, priority, hold)
    return requested


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


# -- cache control (Steer) ---------------------------------------------------------------
_PIN_MODES = {PinMode.SOFT: pb.PIN_MODE_SOFT, PinMode.HARD: pb.PIN_MODE_HARD}
_PIN_MODES_IN = {pb.PIN_MODE_UNSPECIFIED: PinMode.SOFT, **{v: k for k, v in _PIN_MODES.items()}}
_PRIORITIES = {Priority.COLD: pb.RETAIN_PRIORITY_COLD, Priority.NORMAL: pb.RETAIN_PRIORITY_NORMAL,
               Priority.HIGH: pb.RETAIN_PRIORITY_HIGH}
_PRIORITIES_IN = {v: k for k, v in _PRIORITIES.items()}
#: The tiers a demote moves pages down to: host (off the device), or disk (off both).
DEMOTE_TIERS = (Tier.HOST, Tier.DISK)


def check_ttl(ttl: float) -> None:
    """How long a pin or retain lasts: 0 (until unpinned, or its session ends) to
    MAX_TTL_SECONDS."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 <= ttl <= MAX_TTL_SECONDS:
        raise ValueError(f"ttl must be 0 (until the session ends) to {MAX_TTL_SECONDS:.0f} seconds, got {ttl!r}")


def check_demote_tier(tier: Tier) -> None:
    """The tier a demote moves pages below its upper neighbours to."""
    tier = Tier(tier)
    if tier not in DEMOTE_TIERS:
        raise ValueError(f"demote moves pages down to host or disk (TIER_HOST, TIER_DISK), not {tier.label}")


@dataclass(frozen=True)
class Steer:
    """A cache-control request but its keys (kvtier_client.steering says what each action
    does). Only the fields of its action matter: mode and ttl for PIN, priority and ttl for
    RETAIN, tier for DEMOTE; the others stay at their defaults."""

    action: Action
    mode: PinMode = PinMode.SOFT
    ttl: float = 0.0
    priority: Priority = Priority.NORMAL
    tier: Tier = Tier.DISK

    def wire(self) -> tuple[int, int, float, int, int]:
        """(action, pin mode, ttl seconds, priority, tier) as SteerRequest and the lane's
        STEER frame number them, checked by the rule the daemon applies (`read_steer`)."""
        action = Action(self.action)
        numbers = (action.value,
                   _PIN_MODES[PinMode(self.mode)] if action is Action.PIN else pb.PIN_MODE_UNSPECIFIED,
                   float(self.ttl) if action in (Action.PIN, Action.RETAIN) else 0.0,
                   _PRIORITIES[Priority(self.priority)] if action is Action.RETAIN else pb.RETAIN_PRIORITY_UNSPECIFIED,
                   tier_to_proto(self.tier) if action is Action.DEMOTE else pb.TIER_UNSPECIFIED)
        read_steer(*numbers)
        return numbers


def read_steer(action: int, mode: int, ttl: float, priority: int, tier: int) -> Steer:
    """A request's numbers (SteerRequest, the lane's STEER frame) as a Steer. A field the
    action does not take must be left unset (0): a ttl on a drop is a client's mistake."""
    try:
        act = Action(action)
    except ValueError:
        raise ValueError(f"unknown steer action {action}; use STEER_ACTION_PIN, UNPIN, RETAIN, DEMOTE or DROP") from None
    takes = {"pin_mode": act is Action.PIN, "ttl_seconds": act in (Action.PIN, Action.RETAIN),
             "priority": act is Action.RETAIN, "tier": act is Action.DEMOTE}
    stray = [name for name, value in (("pin_mode", mode), ("ttl_seconds", ttl), ("priority", priority),
                                      ("tier", tier)) if value and not takes[name]]
    if stray:
        raise ValueError(f"{act.label} takes no {', '.join(stray)}; leave it unset")
    check_ttl(ttl)
    if act is Action.PIN:
        if mode not in _PIN_MODES_IN:
            raise ValueError(f"unknown pin mode {mode}; use PIN_MODE_SOFT or PIN_MODE_HARD")
        return Steer(act, mode=_PIN_MODES_IN[mode], ttl=ttl)
    if act is Action.RETAIN:
        if priority not in _PRIORITIES_IN:
            raise ValueError(f"a retain names its priority ({priority} is none): RETAIN_PRIORITY_COLD, NORMAL or HIGH")
        return Steer(act, ttl=ttl, priority=_PRIORITIES_IN[priority])
    if act is Action.DEMOTE:
        down_to = _tier(tier, Tier.DISK)
        check_demote_tier(down_to)
        return Steer(act, tier=down_to)
    return Steer(act)
