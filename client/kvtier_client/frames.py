"""The fast lane's frames: the binary messages of the hot calls between a same-host client and
the daemon (docs/protocol.md, "The fast lane", has them byte for byte).

One frame is one SOCK_SEQPACKET message, so the kernel keeps the boundaries and no length
prefix is needed. Every integer is little-endian. A frame starts with an 8-byte header:

    request   u8 version (1) | u8 op | u16 flags  | u32 seq
    reply     u8 version (1) | u8 op | u16 status | u32 seq

`seq` is the client's number for the request, echoed in its reply; `status` is 0, or the
gRPC status code the same error has over gRPC (its UTF-8 message is then the body). Keys
travel as a *key block*: u32 count, u8 width, 3 zero bytes, then `count * width` bytes when
every key is `width` bytes long, or (width 0) each key as u8 length + bytes.

This module only encodes and decodes; it is shared by the client (kvtier_client.lane) and
the daemon (kvtier.server.lane), so the two cannot drift apart. What a request may hold and
how a reply is read (token ids per block, the wait policy, a grant, MAX_FRAME) are the
rules of both transports, in kvtier_client.protocol.
"""
from __future__ import annotations

import enum
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier_client.protocol import MAX_FRAME  # the largest frame either side sends or accepts

VERSION = 1
HEADER = struct.Struct("<BBHI")
#: Request flag: do not answer (Release only); the daemon still applies it in order.
NO_REPLY = 0x1
#: Request flag: the blocks' token ids follow the key block (Commit only).
TOKENS = 0x2
CHECKSUMS = 0x4  # a commit carries each page's xxh3-64 after its token ids
#: Request flag: a u32 hold in milliseconds follows tier and priority (Prefetch only).
HOLD = 0x8
#: Request flag: a u32 `known` (leading keys the engine holds already) follows the key
#: block (Lookup only; sent to daemons whose Register says lookup_known).
KNOWN = 0x10


class Op(enum.IntEnum):
    MALFORMED = 0  # only in replies: to a frame whose header could not be read
    HELLO = 1
    LOOKUP = 2
    BORROW = 3
    COMMIT = 4
    ACQUIRE = 5
    ACQUIRE_PREFIX = 6
    RELEASE = 7
    PREFETCH = 8
    HEARTBEAT = 9
    STEER = 10


_OPS = {op.value: op for op in Op}


class FrameError(ValueError):
    """A frame that does not decode: wrong version, unknown op, short or trailing bytes."""


_KEYS = struct.Struct("<IB3x")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_BORROW_REPLY = struct.Struct("<QBxxxI")  # lease id, tier, slot count
_COMMIT = struct.Struct("<QB")  # lease id, parent length (0: none)
_COMMIT_REPLY = struct.Struct("<II")  # committed, duplicate count
_ACQUIRE = struct.Struct("<BBxxI")  # tier, wait, deadline_ms
_ACQUIRE_REPLY = struct.Struct("<QBxHIII")  # lease id, tier, event length, ready, promoted, slot count
_PREFETCH = struct.Struct("<BxxxI")  # tier, priority (signed in effect: see encode)
_HELLO = struct.Struct("<HHH")  # session id, key and token lengths
_STEER = struct.Struct("<BBBBxxxxd")  # action, pin mode, priority, tier (proto numbers), ttl seconds
_STEER_REPLY = struct.Struct("<IIIH")  # applied, missing, skipped, note length (UTF-8 follows)


# -- the header ------------------------------------------------------------------------
def header(op: Op, seq: int, flags: int = 0) -> bytes:
    return HEADER.pack(VERSION, op, flags, seq)


def with_seq(frame: bytes, seq: int) -> bytes:
    """The frame with its seq set (encoders make frames with seq 0; the connection numbers them)."""
    return frame[:4] + _U32.pack(seq) + frame[HEADER.size :]


def split(frame: bytes | memoryview) -> tuple[Op, int, int, memoryview]:
    """(op, flags or status, seq, body) of a frame."""
    if len(frame) < HEADER.size:
        raise FrameError(f"a frame is at least {HEADER.size} bytes, got {len(frame)}")
    version, number, flags, seq = HEADER.unpack_from(frame)
    if version != VERSION:
        raise FrameError(f"frame version {version}, this side speaks {VERSION}")
    op = _OPS.get(number)  # a dict, not Op(number): the enum's call costs more than the rest
    if op is None:
        raise FrameError(f"unknown op {number}")
    return op, flags, seq, memoryview(frame)[HEADER.size :]


# -- pieces ----------------------------------------------------------------------------
def pack_keys(keys: Sequence[bytes]) -> bytes:
    if not keys:
        return _KEYS.pack(0, 0)
    lengths = set(map(len, keys))  # in C: a per-key Python check would cost more than the send
    if min(lengths) < 1 or max(lengths) > 255:
        raise FrameError("keys on the lane are 1 to 255 bytes")
    if len(lengths) == 1:
        return _KEYS.pack(len(keys), lengths.pop()) + b"".join(keys)
    return _KEYS.pack(len(keys), 0) + b"".join(bytes((len(k),)) + k for k in keys)


def unpack_keys(body: memoryview, at: int = 0) -> tuple[list[bytes], int]:
    """The key block at `at`, and the offset after it."""
    if len(body) < at + _KEYS.size:
        raise FrameError("a key block needs its 8-byte header")
    count, width = _KEYS.unpack_from(body, at)
    at += _KEYS.size
    if width:
        end = at + count * width
        if len(body) < end:
            raise FrameError(f"a key block of {count} keys of {width} bytes is cut short")
        raw = bytes(body[at:end])
        return [raw[i : i + width] for i in range(0, len(raw), width)], end
    keys = []
    for _ in range(count):
        if at >= len(body) or at + 1 + body[at] > len(body):
            raise FrameError(f"a key block of {count} keys is cut short")
        length = body[at]
        if length == 0:
            raise FrameError("a key on the lane is 1 to 255 bytes, got 0")
        keys.append(bytes(body[at + 1 : at + 1 + length]))
        at += 1 + length
    return keys, at


def pack_slots(slots: Sequence[int]) -> bytes:
    return array("I", slots).tobytes()


def unpack_slots(body: memoryview, at: int, count: int) -> tuple[tuple[int, ...], int]:
    end = at + 4 * count
    if len(body) < end:
        raise FrameError(f"{count} slots are cut short")
    slots = array("I")
    slots.frombytes(body[at:end])
    return tuple(slots), end


def done(body: memoryview, at: int) -> None:
    if at != len(body):
        raise FrameError(f"{len(body) - at} bytes after the end of the frame")


# -- requests --------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    session_id: str
    key: str
    token: str | None


def hello(seq: int, session_id: str, key: str, token: str | None) -> bytes:
    parts = [s.encode() for s in (session_id, key, token or "")]
    return header(Op.HELLO, seq, 1 if token is not None else 0) + _HELLO.pack(*map(len, parts)) + b"".join(parts)


def read_hello(flags: int, body: memoryview) -> Hello:
    if len(body) < _HELLO.size:
        raise FrameError("a hello names the session id, key and token lengths")
    lengths = _HELLO.unpack_from(body)
    at, parts = _HELLO.size, []
    for length in lengths:
        parts.append(bytes(body[at : at + length]).decode("utf-8", "replace"))
        at += length
    done(body, at)
    return Hello(parts[0], parts[1], parts[2] if flags & 1 else None)


def lookup(seq: int, keys: Sequence[bytes], known: int = 0) -> bytes:
    """`known` > 0 travels after the key block, flagged KNOWN; 0 is left out (any daemon reads it)."""
    if not known:
        return header(Op.LOOKUP, seq) + pack_keys(keys)
    return header(Op.LOOKUP, seq, KNOWN) + pack_keys(keys) + _U32.pack(known)


def read_lookup(flags: int, body: memoryview) -> tuple[list[bytes], int]:
    """(keys, known: 0 without the KNOWN flag)."""
    keys, at = unpack_keys(body)
    known = 0
    if flags & KNOWN:
        if len(body) < at + _U32.size:
            raise FrameError("a lookup flagged KNOWN ends with a u32 count of known keys")
        (known,) = _U32.unpack_from(body, at)
        at += _U32.size
    done(body, at)
    return keys, known


def borrow(seq: int, count: int) -> bytes:
    return header(Op.BORROW, seq) + _U32.pack(count)


def commit(seq: int, lease_id: int, keys: Sequence[bytes], parent: bytes | None,
           token_ids: Sequence[int] | None = None, checksums: Sequence[int] | None = None) -> bytes:
    """`token_ids`: the blocks' token ids, flat (u32 each), sent after the keys with the
    TOKENS flag; `checksums`: each page's xxh3-64 (u64 each), after those, with the
    CHECKSUMS flag. None sends the frame without them."""
    parent = parent or b""
    if len(parent) > 255:
        raise FrameError("a parent key on the lane is at most 255 bytes")
    flags = (0 if token_ids is None else TOKENS) | (0 if checksums is None else CHECKSUMS)
    frame = header(Op.COMMIT, seq, flags) + _COMMIT.pack(lease_id, len(parent)) + parent
    frame += pack_keys(keys)
    if token_ids is not None:
        frame += _U32.pack(len(token_ids)) + array("I", token_ids).tobytes()
    if checksums is not None:
        frame += _U32.pack(len(checksums)) + array("Q", checksums).tobytes()
    return frame


def _counted(body: memoryview, at: int, typecode: str, what: str, flag: str) -> tuple[array, int]:
    """A u32 count at `at`, then that many items of `typecode`; the array and where it ends."""
    if len(body) < at + 4:
        raise FrameError(f"a commit with the {flag} flag needs the {what[:-1]} count after its keys")
    (count,) = _U32.unpack_from(body, at)
    items = array(typecode)
    at, end = at + 4, at + 4 + items.itemsize * count
    if len(body) < end:
        raise FrameError(f"a commit's {count} {what} are cut short")
    items.frombytes(body[at:end])
    return items, end


def read_commit(flags: int, body: memoryview) -> tuple[int, bytes | None, list[bytes], array | None]:
    """(lease id, parent, keys, token ids or None); `read_commit_checksums` also returns
    the pages' checksums."""
    return read_commit_checksums(flags, body)[:4]


def read_commit_checksums(flags: int, body: memoryview) -> tuple[int, bytes | None, list[bytes], array | None,
                                                                  array | None]:
    """(lease id, parent, keys, token ids or None, checksums or None)"""
    if len(body) < _COMMIT.size:
        raise FrameError("a commit starts with the lease id and the parent's length")
    lease_id, parent_len = _COMMIT.unpack_from(body)
    at = _COMMIT.size + parent_len
    parent = bytes(body[_COMMIT.size : at]) if parent_len else None
    keys, at = unpack_keys(body, at)
    token_ids, at = _counted(body, at, "I", "token ids", "TOKENS") if flags & TOKENS else (None, at)
    checksums, at = _counted(body, at, "Q", "checksums", "CHECKSUMS") if flags & CHECKSUMS else (None, at)
    done(body, at)
    return lease_id, parent, keys, token_ids, checksums


def acquire(seq: int, keys: Sequence[bytes], tier: int, wait: int, deadline_ms: int, *, prefix: bool = False) -> bytes:
    return header(Op.ACQUIRE_PREFIX if prefix else Op.ACQUIRE, seq) + _ACQUIRE.pack(tier, wait, deadline_ms) + pack_keys(keys)


def read_acquire(body: memoryview) -> tuple[int, int, int, list[bytes]]:
    """(tier, wait, deadline_ms, keys)"""
    if len(body) < _ACQUIRE.size:
        raise FrameError("an acquire starts with tier, wait and deadline_ms")
    tier, wait, deadline_ms = _ACQUIRE.unpack_from(body)
    keys, at = unpack_keys(body, _ACQUIRE.size)
    done(body, at)
    return tier, wait, deadline_ms, keys


def release(seq: int, lease_id: int, *, reply: bool) -> bytes:
    return header(Op.RELEASE, seq, 0 if reply else NO_REPLY) + _U64.pack(lease_id)


def prefetch(seq: int, keys: Sequence[bytes], tier: int, priority: int, hold: float = 0.0) -> bytes:
    head = _PREFETCH.pack(tier, priority & 0xFFFFFFFF)
    if hold:
        return header(Op.PREFETCH, seq, HOLD) + head + _U32.pack(round(hold * 1000)) + pack_keys(keys)
    return header(Op.PREFETCH, seq) + head + pack_keys(keys)


def read_prefetch(body: memoryview, flags: int = 0) -> tuple[int, int, float, list[bytes]]:
    """(tier, priority, hold in seconds, keys)"""
    size = _PREFETCH.size + (_U32.size if flags & HOLD else 0)
    if len(body) < size:
        raise FrameError("a prefetch starts with tier and priority (and, flagged HOLD, a u32 hold in ms)")
    tier, priority = _PREFETCH.unpack_from(body)
    hold = _U32.unpack_from(body, _PREFETCH.size)[0] / 1000 if flags & HOLD else 0.0
    keys, at = unpack_keys(body, size)
    done(body, at)
    return tier, priority - (1 << 32) if priority >= 1 << 31 else priority, hold, keys


def steer(seq: int, keys: Sequence[bytes], action: int, mode: int, ttl: float, priority: int, tier: int) -> bytes:
    """A cache-control request: kvtier_client.protocol.Steer.wire's numbers, then the keys."""
    return header(Op.STEER, seq) + _STEER.pack(action, mode, priority, tier, ttl) + pack_keys(keys)


def read_steer(body: memoryview) -> tuple[int, int, float, int, int, list[bytes]]:
    """(action, pin mode, ttl seconds, priority, tier, keys): the numbers as sent, for
    kvtier_client.protocol.read_steer to check."""
    if len(body) < _STEER.size:
        raise FrameError("a steer starts with action, pin mode, priority, tier and ttl")
    action, mode, priority, tier, ttl = _STEER.unpack_from(body)
    keys, at = unpack_keys(body, _STEER.size)
    done(body, at)
    return action, mode, ttl, priority, tier, keys


def heartbeat(seq: int) -> bytes:
    return header(Op.HEARTBEAT, seq)


def read_u32(body: memoryview) -> int:
    if len(body) != 4:
        raise FrameError(f"expected a 4-byte count, got {len(body)} bytes")
    return _U32.unpack_from(body)[0]


def read_u64(body: memoryview) -> int:
    if len(body) != 8:
        raise FrameError(f"expected an 8-byte lease id, got {len(body)} bytes")
    return _U64.unpack_from(body)[0]


# -- replies ---------------------------------------------------------------------------
def reply(op: Op, seq: int, body: bytes = b"") -> bytes:
    return HEADER.pack(VERSION, op, 0, seq) + body


def error(op: Op, seq: int, status: int, message: str) -> bytes:
    return HEADER.pack(VERSION, op, status, seq) + message.encode()[: MAX_FRAME - HEADER.size]


@dataclass(frozen=True)
class Grant:
    """A lease as a reply carries it (Borrow, Acquire, AcquirePrefix: lease_id NO_LEASE when
    none is granted); kvtier_client.protocol.read_grant reads it."""

    lease_id: int
    tier: int
    slots: tuple[int, ...]
    ready: int = 0
    promoted: int = 0
    ready_event: bytes = b""


def pack_lookup(hit_blocks: int, tiers: bytes) -> bytes:
    """`tiers`: one proto tier number per hit block (kvtier_client.wire.tiers_to_proto_bytes)."""
    return _U32.pack(hit_blocks) + tiers


def unpack_lookup(body: memoryview, at: int = 0) -> tuple[int, bytes, int]:
    """(hit_blocks, their proto tier numbers as bytes, the offset after them)."""
    if len(body) < at + 4:
        raise FrameError("a lookup reply starts with hit_blocks")
    (hit,) = _U32.unpack_from(body, at)
    end = at + 4 + hit
    if len(body) < end:
        raise FrameError("a lookup reply's tiers are cut short")
    return hit, bytes(body[at + 4 : end]), end


def pack_borrow(lease_id: int, tier: int, slots: Sequence[int]) -> bytes:
    return _BORROW_REPLY.pack(lease_id, tier, len(slots)) + pack_slots(slots)


def unpack_borrow(body: memoryview) -> Grant:
    if len(body) < _BORROW_REPLY.size:
        raise FrameError("a borrow reply is cut short")
    lease_id, tier, count = _BORROW_REPLY.unpack_from(body)
    slots, at = unpack_slots(body, _BORROW_REPLY.size, count)
    done(body, at)
    return Grant(lease_id, tier, slots)


def pack_commit(committed: int, duplicates: Sequence[int]) -> bytes:
    return _COMMIT_REPLY.pack(committed, len(duplicates)) + pack_slots(duplicates)


def unpack_commit(body: memoryview) -> tuple[int, tuple[int, ...]]:
    if len(body) < _COMMIT_REPLY.size:
        raise FrameError("a commit reply is cut short")
    committed, count = _COMMIT_REPLY.unpack_from(body)
    duplicates, at = unpack_slots(body, _COMMIT_REPLY.size, count)
    done(body, at)
    return committed, duplicates


def pack_acquire(grant: Grant) -> bytes:
    return (_ACQUIRE_REPLY.pack(grant.lease_id, grant.tier, len(grant.ready_event), grant.ready, grant.promoted,
                                len(grant.slots))
            + pack_slots(grant.slots) + grant.ready_event)


def unpack_acquire(body: memoryview, at: int = 0) -> Grant:
    if len(body) < at + _ACQUIRE_REPLY.size:
        raise FrameError("an acquire reply is cut short")
    lease_id, tier, event_len, ready, promoted, count = _ACQUIRE_REPLY.unpack_from(body, at)
    slots, at = unpack_slots(body, at + _ACQUIRE_REPLY.size, count)
    event = bytes(body[at : at + event_len])
    done(body, at + event_len)
    return Grant(lease_id, tier, slots, ready, promoted, event)


def pack_steer(applied: int, missing: int, skipped: int, note: str) -> bytes:
    text = note.encode()[:0xFFFF]
    return _STEER_REPLY.pack(applied, missing, skipped, len(text)) + text


def unpack_steer(body: memoryview) -> tuple[int, int, int, str]:
    """(applied, missing, skipped, note)"""
    if len(body) < _STEER_REPLY.size:
        raise FrameError("a steer reply is cut short")
    applied, missing, skipped, length = _STEER_REPLY.unpack_from(body)
    end = _STEER_REPLY.size + length
    if len(body) < end:
        raise FrameError("a steer reply's note is cut short")
    done(body, end)
    return applied, missing, skipped, bytes(body[_STEER_REPLY.size : end]).decode("utf-8", "replace")
