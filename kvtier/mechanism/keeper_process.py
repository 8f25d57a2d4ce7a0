"""The arena keeper process (what it is for: kvtier.mechanism.keeper). Spawned by a daemon
(`python -m kvtier.mechanism.keeper`), it serves that daemon and its successor and exits
when neither needs it. Standalone (`kvtier keeper`, a container of its own next to the
daemon's), it serves daemons one after another for as long as it runs: a crashed daemon's
files are kept for the window, then freed; a clean stop (`clear`) frees them at once; it
ends on SIGTERM. Both end cleanly on SIGTERM or SIGINT (socket removed, files freed).

It trusts its own uid and root, as the daemon does: such a
process can take every namespace's memory, or end the keeper (docs/security.md). What it
does not trust is that such a process speaks the protocol. Each connection is one
*conversation*, served by one event loop in one thread that never blocks on a peer:

- a conversation that is not a daemon's gets one request, checked (keeper_wire), and its
  answer, and must keep moving: silent for `_SILENCE` (1 s), or open for `_LIFETIME` in
  all, and the keeper hangs up; a message that is not a request gets an error and a
  hang-up; a peer that hung up early or does not read costs its own conversation only;
- a daemon's conversation (a `list` with `hold`) stays open; its hang-up starts the linger;
- at most `_CONVERSATIONS` are open at once (more wait in the listen backlog), at most
  `_HOLDERS` of them daemons', and at most `_FILES` files are kept.

A keeper keeps one daemon's files: a hold that names another daemon (`owner`, its socket
path) frees them and lets go of the daemon that kept them, so no daemon adopts another's
pages.

So no peer ends the keeper or loses a file it keeps, other than by asking for it (`exit`,
`clear`, `drop`, a `keep` of the same name, a hold as another daemon) or by a signal; and none delays a daemon's start, unless
`_CONVERSATIONS` are silent at once (then by a second for each such crowd ahead of it).
"""
from __future__ import annotations

import logging
import os
import resource
import selectors
import signal
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from kvtier.mechanism.keeper_wire import (
    BadMessage, Op, Request, close_all, parse_request, peer_credentials, receive, send, socket_address,
)

log = logging.getLogger(__name__)

#: How long a new keeper waits for the daemon that spawned it to hold it.
_FIRST_HOLD = 10.0
#: A conversation that is not a daemon's: hung up after this long without a request or a
#: reply taken, and after `_LIFETIME` in all.
_SILENCE = 1.0
_LIFETIME = 10.0
_CONVERSATIONS = 64
#: Daemons' conversations at once (only one daemon serves a socket; more are impostors or
#: leftovers): the one that holds the longest is let go for a new one.
_HOLDERS = 8
#: Kept files at most (a daemon keeps a slot table per layout and a file per namespace and
#: layout); with names and metas at their bounds, about 40 MiB. Fewer if the descriptor
#: limit is lower: room stays for every conversation.
_FILES = 16384
#: Refusals logged: at most one line a second, counting the rest.
_LOG_EVERY = 1.0
#: Messages of one daemon's conversation taken in a row (a daemon sends a few at a time).
_BURST = 64


@dataclass(eq=False)
class _Conversation:
    """One peer's connection. Its first message is its request; a `list` with `hold` makes
    it a daemon's (`holder`), whose keeps, drops and exit follow for as long as it stays."""

    sock: socket.socket
    pid: int
    opened: float
    heard: float  # the last request, or reply taken
    holder: bool = False
    answered: bool = False  # not a holder, and its one request is in: hang up once its replies are out
    replies: deque[str | dict] = field(default_factory=deque)  # names still to list, or whole messages

    def deadline(self) -> float | None:
        if self.holder:
            return self.heard + _SILENCE if self.replies else None
        return min(self.heard + _SILENCE, self.opened + _LIFETIME)

    def events(self) -> int:
        wanted = 0 if self.answered else selectors.EVENT_READ
        return wanted | (selectors.EVENT_WRITE if self.replies else 0)


class _Stop(Exception):
    """An `exit` request, or SIGTERM."""


_END = {"end": True}  # a listing's last message


class Keeper:
    """The keeper process: one event loop over the listener and every conversation."""

    def __init__(self, path: str, linger: float, *, standalone: bool = False) -> None:
        self.path = path
        self.linger = linger
        self.standalone = standalone  # serves daemons one after another until SIGTERM
        self.files: dict[str, tuple[dict, int]] = {}  # name -> (meta, descriptor)
        self.owner = ""  # the daemon whose files these are (its socket path); "" = none named
        self.talks: dict[socket.socket, _Conversation] = {}
        self.held = False  # a daemon has held us (so its going starts the linger)
        self.alone_since = time.monotonic()  # since when no daemon holds us
        self.max_files = _FILES
        self._log_next, self._unlogged = 0.0, 0
        self._deaf_until = 0.0  # accepting paused (out of descriptors) until then
        self._selector = selectors.DefaultSelector()  # epoll: descriptors beyond 1024 are the rule here
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._listening = False

    def serve(self) -> None:
        self._raise_file_limit()
        listener = self._listener
        old = os.umask(0o177)
        try:
            with socket_address(self.path) as address:
                listener.bind(address)  # mode 0600: only our uid (and root) may connect
        finally:
            os.umask(old)
        bound = os.stat(self.path).st_ino
        listener.listen(_CONVERSATIONS)
        listener.setblocking(False)
        signalled = self._wake_on_signals()
        try:
            while (timeout := self._tick()) is not False:
                for key, events in self._selector.select(timeout):
                    if key.fileobj == signalled:
                        log.info("signalled: freeing %d kept files and exiting", len(self.files))
                        raise _Stop
                    if key.fileobj is listener:
                        self._accept()
                    elif key.fileobj in self.talks:  # not hung up by an earlier event of this round
                        self._serve(self.talks[key.fileobj], events)
        except _Stop:
            pass
        finally:
            try:
                if os.stat(self.path).st_ino == bound:  # not a successor keeper's socket
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
            listener.close()
            self._free_all()
            for talk in list(self.talks.values()):
                talk.sock.close()
            self._selector.close()

    def _wake_on_signals(self) -> int:
        """SIGTERM and SIGINT written to a pipe the event loop watches (a Python handler
        alone would run only once select() returns): the descriptor to watch."""
        readable, writable = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(writable)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        self._selector.register(readable, selectors.EVENT_READ)
        return readable

    def _raise_file_limit(self) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        room = (soft if soft != resource.RLIM_INFINITY else _FILES) - 2 * _CONVERSATIONS - 32
        self.max_files = max(0, min(_FILES, room))

    def _tick(self) -> float | None | bool:
        """Hang up on conversations past their deadline and decide whether to go on: the
        select timeout (None: none), or False to exit."""
        now = time.monotonic()
        for talk in [t for t in self.talks.values() if (d := t.deadline()) is not None and d <= now]:
            self._hang_up(talk)
        deadlines = [d for t in self.talks.values() if (d := t.deadline()) is not None]
        if not any(t.holder for t in self.talks.values()):
            if not self.files and (self.held or self.standalone):
                if not self.standalone:
                    return False  # the daemon went, leaving nothing to keep
                self.held = False
            else:
                end = self.alone_since + (self.linger if self.held or self.standalone else _FIRST_HOLD)
                if now < end:
                    deadlines.append(end)
                elif not self.standalone:
                    log.warning("no daemon came back for %.0f s: freeing %d kept files", end - self.alone_since, len(self.files))
                    return False
                else:
                    log.warning("no daemon came back for %.0f s: freed %d kept files; waiting for the next daemon",
                                end - self.alone_since, len(self.files))
                    self._free_all()
                    self.held = False
        listen = len(self.talks) < _CONVERSATIONS and now >= self._deaf_until
        if now < self._deaf_until:
            deadlines.append(self._deaf_until)
        if listen != self._listening:
            if listen:
                self._selector.register(self._listener, selectors.EVENT_READ)
            else:
                self._selector.unregister(self._listener)
            self._listening = listen
        return max(min(deadlines) - now, 0.0) if deadlines else None

    def _accept(self) -> None:
        while len(self.talks) < _CONVERSATIONS:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of descriptors (the cap on kept files leaves room): no spinning
                log.warning("cannot accept a connection: %s; pausing 100 ms", exc)
                self._deaf_until = time.monotonic() + 0.1
                return
            sock.setblocking(False)
            pid, uid, _ = peer_credentials(sock)
            if uid not in (os.getuid(), 0):
                sock.close()
                continue
            now = time.monotonic()
            self.talks[sock] = talk = _Conversation(sock, pid, now, now)
            self._selector.register(sock, talk.events())

    def _serve(self, talk: _Conversation, events: int) -> None:
        try:
            if events & selectors.EVENT_WRITE:
                self._flush(talk)
            if events & selectors.EVENT_READ and not talk.answered:
                self._hear(talk)
        except OSError:  # EPIPE, ECONNRESET: the peer went; only this conversation ends
            self._hang_up(talk)
            return
        if talk.sock not in self.talks:
            return
        if talk.answered and not talk.replies:
            self._hang_up(talk)
        else:
            self._selector.modify(talk.sock, talk.events())

    def _hear(self, talk: _Conversation) -> None:
        """Take what the peer sent: its one request, or all that a daemon's conversation has
        queued (at most `_BURST`), so that what a daemon sent before another peer connected
        is done before that peer's request is read."""
        for _ in range(_BURST):
            try:
                data, fds, flags = receive(talk.sock)
            except BlockingIOError:
                return
            if not data and not fds:
                self._hang_up(talk)
                return
            try:
                request = parse_request(data, fds, flags)
            except BadMessage as exc:
                close_all(fds)
                self._refuse(talk, str(exc))
                return
            talk.heard = time.monotonic()
            self._do(talk, request)
            if talk.sock not in self.talks:
                return
            if not talk.holder:
                talk.answered = True
                return

    def _do(self, talk: _Conversation, request: Request) -> None:
        if request.op is Op.EXIT:
            if self.standalone:
                self._refuse(talk, "a standalone keeper ends on SIGTERM, not on request (clear frees what it keeps)")
                return
            raise _Stop
        if request.op in (Op.LIST, Op.STATUS) and talk.holder:
            self._refuse(talk, f"a daemon's conversation asks no {request.op.value} (it lists once, at its start)")
            return
        if request.op is Op.STATUS:
            talk.replies.append({"files": len(self.files), "held": any(t.holder for t in self.talks.values())})
        elif request.op is Op.CLEAR:
            if self.files:
                log.info("freeing %d kept files as asked (pid %d)", len(self.files), talk.pid)
            self._free_all()
            self._hang_up(talk)  # the daemon waits for this: everything is freed by then
        elif request.op is Op.LIST:
            if request.hold:
                self._claim(talk, request.owner)
            talk.replies.extend(self.files)
            talk.replies.append(_END)
            if request.hold:
                self._hold(talk)
        elif request.op is Op.KEEP:
            if request.name not in self.files and len(self.files) >= self.max_files:
                os.close(request.fd)
                self._refuse(talk, f"the keeper already holds {len(self.files)} files, its most", hang_up=not talk.holder)
                return
            old = self.files.pop(request.name, None)
            if old is not None:
                os.close(old[1])
            self.files[request.name] = (request.meta, request.fd)
        elif request.op is Op.DROP:
            old = self.files.pop(request.name, None)
            if old is not None:
                os.close(old[1])

    def _claim(self, talk: _Conversation, owner: str) -> None:
        """Before a daemon named `owner` holds: files kept for a daemon of another name are
        freed, and the daemons holding for it let go, rather than handed over."""
        if not owner or owner == self.owner:
            return
        others = [t for t in self.talks.values() if t.holder and t is not talk]
        if self.owner and (self.files or others):
            log.warning("the daemon of %s holds the keeper: freeing the %d files kept for the daemon of %s",
                        owner, len(self.files), self.owner)
            for other in others:
                self._hang_up(other)
            self._free_all()
        self.owner = owner

    def _free_all(self) -> None:
        close_all([fd for _, fd in self.files.values()])
        self.files.clear()
        self.owner = ""

    def _hold(self, talk: _Conversation) -> None:
        talk.holder, self.held = True, True
        holders = [t for t in self.talks.values() if t.holder]
        if len(holders) > _HOLDERS:
            oldest = min(holders, key=lambda t: t.opened)
            log.warning("a daemon connected while %d hold the keeper: letting go of the oldest (pid %d)",
                        len(holders) - 1, oldest.pid)
            self._hang_up(oldest)

    def _flush(self, talk: _Conversation) -> None:
        """Send what fits of a listing; the rest when the peer has read some. A file
        dropped meanwhile is left out."""
        while talk.replies:
            reply = talk.replies[0]
            entry = self.files.get(reply) if isinstance(reply, str) else None
            try:
                if isinstance(reply, dict):
                    send(talk.sock, reply)
                elif entry is not None:
                    send(talk.sock, {"name": reply, "meta": entry[0]}, entry[1])
            except BlockingIOError:
                return
            talk.replies.popleft()
            talk.heard = time.monotonic()

    def _refuse(self, talk: _Conversation, why: str, *, hang_up: bool = True) -> None:
        """Say what was wrong (a daemon's conversation reads no errors: the log has them)."""
        now = time.monotonic()
        if now >= self._log_next:
            more = f" ({self._unlogged} more refused since the last line)" if self._unlogged else ""
            log.warning("refused a request from pid %d: %s%s", talk.pid, why, more)
            self._log_next, self._unlogged = now + _LOG_EVERY, 0
        else:
            self._unlogged += 1
        if not talk.holder:
            try:
                send(talk.sock, {"error": why})
            except OSError:
                pass
        if hang_up:
            self._hang_up(talk)

    def _hang_up(self, talk: _Conversation) -> None:
        self._selector.unregister(talk.sock)
        del self.talks[talk.sock]
        talk.sock.close()
        if talk.holder and not any(t.holder for t in self.talks.values()):
            self.alone_since = time.monotonic()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m kvtier.mechanism.keeper SOCKET_PATH LINGER_SECONDS", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="kvtier keeper: %(message)s")
    Keeper(argv[0], float(argv[1])).serve()
    return 0


