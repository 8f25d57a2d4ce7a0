"""The fast lane: the hot calls of same-host clients as binary frames over a Unix
SOCK_SEQPACKET socket (kvtier_client.frames; docs/protocol.md, "The fast lane").

Python gRPC costs ~0.5 ms a call; a frame on a Unix socket costs microseconds. The lane
carries only what an engine does per request (Lookup, Borrow, Commit, Acquire, Release,
Prefetch, Heartbeat, Steer); Register, Stats, admin and remote clients stay on gRPC.

A connection serves one session. Its first frame is a HELLO naming the session, its key
and the token that opened it; the kernel names the connecting process (SO_PEERCRED), which
must be the one that attached the session over the handoff socket. Every later frame is
checked against the session again (SessionManager.still: the session still open, its token
still granted), and runs on the connection's own thread, in the order sent: a Release
sent without waiting for its reply is applied before the next frame of that connection.
A client opens one connection per calling thread, so each thread's calls keep their order.

Until its HELLO a connection is the listener's (kvtier.server.listener): it waits under its
own deadline without a thread, and counts against its peer uid's limit, as every open
connection does; a connection gets its thread once its HELLO arrived. A frame is one
SOCK_SEQPACKET message, so there are no half frames to wait for: a short one is answered
INVALID_ARGUMENT like any frame that does not decode.
"""
from __future__ import annotations

import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

import grpc
from kvtier_client import frames, protocol
from kvtier_client.errors import InvalidArgument, KVTierError, PermissionDenied
from kvtier_client.frames import FrameError, Op
from kvtier_client.ids import short_session
from kvtier_client.wire import tier_to_proto, tiers_to_proto_bytes

from kvtier.core.results import ReadGrant
from kvtier.server.listener import Connection, PeerLimits, Refusal, SeqpacketListener
from kvtier.server.metrics import Metrics
from kvtier.server.ops import HotOps, Resolve, grant_fields, steer_of
from kvtier.server.sessions import Caller, Process, Session, SessionManager

log = logging.getLogger(__name__)

#: A reply the client does not take within this long ends its connection: a client that
#: sends and never reads would otherwise hold a thread and one of its uid's places for good.
SEND_TIMEOUT_S = 5

_STATUS = {code.name: code.value[0] for code in grpc.StatusCode}
#: The metric's method label of each op: the gRPC method's name, so both transports line up.
_METHOD = {op: "".join(part.title() for part in op.name.split("_")) for op in Op}
#: poll() bits of a peer that hung up: how an end of file differs from a zero-length frame.
_HUNG_UP = select.POLLHUP | select.POLLRDHUP


def lane_path(socket_path: str) -> str:
    return f"{socket_path}.lane"


class Lane:
    """The listening socket, its accept thread, and one thread per connection past its HELLO.
    Past a uid's limit a connection is refused with UNAVAILABLE and the client keeps using
    gRPC."""

    def __init__(self, path: str, sessions: SessionManager, ops: HotOps, metrics: Metrics,
                 limits: PeerLimits = PeerLimits(), mode: int = 0o660) -> None:
        self.path = path
        self._listener = SeqpacketListener(path, mode, "lane", self, limits, first_bytes=protocol.MAX_FRAME,
                                           on_refused=metrics.local_connection_refused)
        self._sessions = sessions
        self._ops = ops
        self._metrics = metrics
        self._lock = threading.Lock()
        self._connections: dict[Connection, threading.Thread] = {}
        self._timers: dict = {}
        self._handlers: dict[Op, Callable[[Resolve, int, int, memoryview], bytes | None]] = {
            Op.HEARTBEAT: self._heartbeat, Op.LOOKUP: self._lookup, Op.BORROW: self._borrow, Op.COMMIT: self._commit,
            Op.ACQUIRE: self._acquire, Op.ACQUIRE_PREFIX: self._acquire_prefix, Op.RELEASE: self._release,
            Op.PREFETCH: self._prefetch, Op.STEER: self._steer,
        }

    def start(self) -> None:
        self._listener.start()

    def stop(self) -> None:
        """Stop accepting, end every connection (their threads finish the frame they run)."""
        if not self._listener.stop():
            return
        with self._lock:
            connections = list(self._connections.items())
        for connection, _ in connections:
            try:
                connection.sock.shutdown(socket.SHUT_RDWR)  # wakes recv()
            except OSError:
                pass
        for _, thread in connections:
            thread.join()

    def _timer(self, op: Op | None, code: str):
        """The duration histogram's child for (op, code), made once: labels() costs more than
        a lane call's own bookkeeping."""
        timer = self._timers.get((op, code))
        if timer is None:
            timer = self._timers[(op, code)] = self._metrics.rpc_duration.labels(_METHOD.get(op, "Malformed"), code, "lane")
        return timer

    def serve(self, connection: Connection) -> None:
        """A connection whose HELLO arrived: its own thread from now on."""
        thread = threading.Thread(target=self._serve, args=(connection,), name="kvtier-lane-conn", daemon=True)
        with self._lock:
            self._connections[connection] = thread
        thread.start()

    def refusal(self, reason: Refusal, message: str) -> bytes:
        status = _STATUS["DEADLINE_EXCEEDED" if reason is Refusal.DEADLINE else "UNAVAILABLE"]
        return frames.error(Op.HELLO, 0, status, f"{message}; the client stays on gRPC")

    # -- one connection -----------------------------------------------------------------
    def _serve(self, connection: Connection) -> None:
        conn = connection.sock
        try:
            with connection:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, protocol.LANE_BUFFER_BYTES)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, protocol.LANE_BUFFER_BYTES)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_S, 0))
                session = self._hello(conn, connection.process, connection.first)
                if session is not None:
                    self._frames(conn, session)
        except OSError as exc:
            log.debug("lane connection ended", extra={"reason": str(exc)})
        except Exception:
            log.exception("internal error on a lane connection")
        finally:
            with self._lock:
                self._connections.pop(connection, None)

    def _hello(self, conn: socket.socket, process: Process, first: bytes) -> Session | None:
        """The session this connection serves, its credentials checked; None (having
        answered why) if the HELLO is refused."""
        seq = 0
        try:
            op, flags, seq, body = frames.split(first)
            if op is not Op.HELLO:
                raise InvalidArgument(f"a lane connection starts with HELLO, got {op.name}")
            hello = frames.read_hello(flags, body)
            caller = Caller(hello.key, hello.token, None)
            session = self._sessions.get(hello.session_id, caller)
            if session.process is None or session.process.pid != process.pid:
                raise PermissionDenied(
                    f"session {short_session(session.session_id)} is attached to another process: only the process "
                    "that attached a session over the handoff socket may use it on the lane"
                )
        except FrameError as exc:
            conn.send(frames.error(Op.HELLO, seq, _STATUS["INVALID_ARGUMENT"], f"malformed HELLO: {exc}"))
            return None
        except KVTierError as exc:
            conn.send(frames.error(Op.HELLO, seq, _STATUS.get(exc.code, _STATUS["UNKNOWN"]), str(exc)))
            return None
        conn.send(frames.reply(Op.HELLO, seq))
        return session

    def _frames(self, conn: socket.socket, session: Session) -> None:
        buffer = bytearray(protocol.MAX_FRAME)
        view = memoryview(buffer)
        hangup = select.poll()
        hangup.register(conn, _HUNG_UP)
        while True:
            size = conn.recv_into(buffer, 0, socket.MSG_TRUNC)  # MSG_TRUNC: the real size, even if cut
            if size == 0 and hangup.poll(0):
                return  # the client closed it (else it was a zero-length frame: answered below)
            op, seq, answer = self._one(view[: min(size, len(buffer))], size, session)
            if answer is not None:
                conn.send(answer)

    def _one(self, frame: memoryview, size: int, session: Session) -> tuple[Op | None, int, bytes | None]:
        """Run one frame: (op, seq, the reply to send, or None for a no-reply Release). A
        frame whose header does not decode is answered as op MALFORMED."""
        start = time.perf_counter()
        op: Op | None = None
        seq, code, no_reply = 0, "OK", False
        try:
            op, flags, seq, body = frames.split(frame)  # an oversized frame's header is in its first bytes
            no_reply = op is Op.RELEASE and bool(flags & frames.NO_REPLY)
            if size > protocol.MAX_FRAME:
                raise InvalidArgument(f"a lane frame is at most {protocol.MAX_FRAME} bytes, got {size}; send fewer keys "
                                      "per call (the client sends larger requests over gRPC)")
            handler = self._handlers.get(op)
            if handler is None:
                raise InvalidArgument(f"{op.name} is not a call on an open lane connection")
            answer = handler(lambda: self._sessions.still(session), seq, flags, body)
            return op, seq, None if no_reply else answer
        except FrameError as exc:
            code = "INVALID_ARGUMENT"
            message = f"malformed {op.name if op else 'lane'} frame: {exc}"
        except KVTierError as exc:
            code = exc.code
            message = str(exc)
        except Exception:
            code = "INTERNAL"
            log.exception("internal error in lane call %s", op.name if op else "?")
            message = f"internal error in {op.name if op else 'a lane call'}; the daemon log has the details"
        finally:
            self._timer(op, code).observe(time.perf_counter() - start)
        if no_reply:
            log.info("a Release sent without reply failed", extra={"code": code, "reason": message})
            return op, seq, None
        return op, seq, frames.error(op or Op.MALFORMED, seq, _STATUS.get(code, _STATUS["UNKNOWN"]), message)

    # -- the calls ----------------------------------------------------------------------
    def _heartbeat(self, s: Resolve, seq: int, flags: int, body: memoryview) -> bytes:
        frames.done(body, 0)
        return frames.reply(Op.HEARTBEAT, seq, frames.pack_slots([self._ops.heartbeat(s)]))

    def _lookup(self, s: Resolve, seq: int, flags: int, body: memoryview) -> bytes:
        keys, known = frames.read_lookup(flags, body)
        match = self._ops.lookup(s, keys, known)
        return frames.reply(Op.LOOKUP, seq, frames.pack_lookup(match.hit_blocks, tiers_to_proto_bytes(match.tiers)))

    def _borrow(self, s: Resolve, seq: int, flags: int, body: memoryview) -> bytes:
        grant = self._ops.borrow(s, frames.read_u32(body))
        return frames.reply(Op.BORROW, seq, frames.pack_borrow(grant.lease_id, tier_to_proto(grant.tier), grant.slots))

    def _commit(self, s: Resolve, seq: int, flags: int, body: memoryview) -> bytes:
        lease_id, parent, keys, token_ids, checksums = frames.read_commit_checksums(flags, body)
        outcome = self._ops.commit(s, lease_id, keys, parent, token_ids or (), checksums or ())
        return frames.reply(Op.COMMIT, seq, frames.pack_commit(outcome.committed, outcome.duplicates))

    def _acquire(self, s: Resolve, seq: int, flags: int, body: memoryview) -> bytes:
        tier, wait, deadline_ms, keys = frames.read_acquire(body)
        return frames.reply(Op.ACQUIRE, seq, frames.pack_acquire(_grant(self._ops.acquire(s, keys, tier, wait, deadline_ms))))

    def _acquire_prefix(self, s: Resolve, seq: int, flags: int, body: memoryview) -> bytes:
        tier, wait, deadline_ms, keys = frames.read_acquire(body)
        match, grant = self._ops.acquire_prefix(s, keys, tier, wait, deadline_ms)
        lookup = frames.pack_lookup(match.hit_blocks, tiers_to_proto_bytes(match.tiers))
        lease = frames.pack_acquire(_grant(grant) if grant is not None else frames.Grant(protocol.NO_LEASE, 0, ()))
        return frames.reply(Op.ACQUIRE_PREFIX, seq, lookup + lease)

    def _release(self, s: Resolve, seq: int, flags: int, body: memoryview) -> bytes:
        self._ops.release(s, frames.read_u64(body))
        return frames.reply(Op.RELEASE, seq)

    def _prefetch(self, s: Resolve, seq: int, flags: int, body: memoryview) -> bytes:
        tier, priority, hold, keys = frames.read_prefetch(body, flags)
        return frames.reply(Op.PREFETCH, seq, frames.pack_slots([self._ops.prefetch(s, keys, tier, priority, hold)]))

    def _steer(self, s: Resolve, seq: int, flags: int, body: memoryview) -> bytes:
        action, mode, ttl, priority, tier, keys = frames.read_steer(body)
        steer = steer_of(action, mode, ttl, priority, tier)
        result = self._ops.steer(s, steer, keys)
        self._metrics.steered(steer.action, result)
        return frames.reply(Op.STEER, seq, frames.pack_steer(result.applied, result.missing, result.skipped, result.note))


def _grant(grant: ReadGrant) -> frames.Grant:
    """A core ReadGrant as the reply carries it (the fields AcquireResponse has over gRPC)."""
    return frames.Grant(**grant_fields(grant))

