"""Silent clients on the daemon's local sockets (the handoff socket and the fast lane), from
another process of the same uid and from another uid: they never delay anyone else's attach
or HELLO, and past its per-uid limit a uid is refused at once while other uids are served.

The silent clients run in a child process that keeps its N connections open: each one the
daemon ends (its first-message deadline passed, or it was refused) is opened again, as a
slow-loris attacker would. Times are asserted only against a bound far below the old
serialised wait (about 5 s per 16 silent connections, past the client's 10 s timeout) and
relative to a baseline attach measured in the same run, so a loaded machine cannot make
these tests flaky; `-s` prints the figures.
"""
from __future__ import annotations

import json
import os
import select
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from kvtier_client import frames
from kvtier_client.errors import Unavailable
from kvtier_client.handoff import attach
from rpc import Conn, free_port, register_request, samples, scrape

#: Another uid for the hostile process (root can become it; the socket's group, root, stays).
OTHER_UID = 65534
PER_UID = 256  # the default of local_connections_per_uid
#: How long the silent client may take to open its connections (a daemon that accepts them
#: at once takes milliseconds; one that waits on them never gets there).
READY_S = 20

SILENT = textwrap.dedent(
    """
    import json, os, selectors, socket, sys, time
    directory, name, count, uid = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    where = os.open(directory, os.O_PATH)  # reached through this descriptor after setuid
    if uid != os.getuid():
        os.setgroups([])
        os.setuid(uid)  # keeps gid 0: the socket's group may connect (mode 0660)
    path = f"/proc/self/fd/{where}/{name}"
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ)
    ended = answered = 0  # connections the daemon ended; of those, with a message first
    ready = False
    refill = 0.0  # when the ended ones were last opened again: at most 20 times a second

    def fill():
        while len(sel.get_map()) - 1 < count:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(0.2)
            try:
                s.connect(path)
            except OSError:  # the listen backlog is full: the daemon is not accepting
                s.close()
                return
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)

    while True:
        if time.monotonic() - refill >= 0.05:
            fill()
            refill = time.monotonic()
        if not ready and len(sel.get_map()) - 1 == count:
            ready = True
            print("ready", flush=True)
        for key, _ in sel.select(0.05):
            if key.fileobj is sys.stdin:
                print(json.dumps({"ended": ended, "answered": answered}), flush=True)
                sys.exit(0)
            try:
                answered += bool(key.fileobj.recv(65536))
            except OSError:
                pass
            ended += 1
            sel.unregister(key.fileobj)
            key.fileobj.close()
    """
)


class Silent:
    """A child process holding `count` silent connections to `path`, as `uid`."""

    def __init__(self, path: str, count: int, uid: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SILENT, os.path.dirname(path), os.path.basename(path), str(count), str(uid)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        opened = select.select([self.proc.stdout], [], [], READY_S)[0]
        line = self.proc.stdout.readline() if opened else ""
        assert line == "ready\n", (f"the silent client could not open {count} connections within {READY_S}s: the "
                                   "daemon does not accept them (its listen backlog stays full)")

    def stop(self) -> dict:
        """{"ended": connections the daemon ended, "answered": of those, with a refusal first}."""
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        try:
            return json.loads(self.proc.stdout.readline())
        finally:
            self.proc.wait(10)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def silent():
    started: list[Silent] = []

    def start(path: str, count: int, uid: int | None = None) -> Silent:
        started.append(Silent(path, count, os.getuid() if uid is None else uid))
        return started[-1]

    yield start
    for child in started:
        child.kill()


@pytest.fixture
def daemon(daemons):
    port = free_port()
    d = daemons.start("--metrics-port", str(port), disk_size="0")
    d.metrics_port = port
    os.chmod(d.socket.parent, 0o750)  # as a deployment shares it with the engines' group
    return d


def other_uid_possible() -> bool:
    return os.getuid() == 0


#: The loaded figures are taken over this long, past the daemon's 1 s first-message deadline,
#: so the attaches also meet the silent connections the daemon dropped and the child reopened.
SPAN_S = 2.5


def spread(count: int, span: float):
    """`count` steps over `span` seconds (0: back to back)."""
    for i in range(count):
        yield i
        time.sleep(span / count)


def attach_times(conn: Conn, count: int, span: float = 0.0) -> list[float]:
    """Seconds of `count` attaches of fresh sessions over `span` seconds (Register is not timed)."""
    times = []
    for _ in spread(count, span):
        reply = conn.call("Register", register_request("attach-timing"))
        start = time.perf_counter()
        attachment = attach(reply.handoff_socket, reply.session_id, None)
        times.append(time.perf_counter() - start)
        os.close(attachment.arena_fd)
    return times


def hello_times(conn: Conn, count: int, span: float = 0.0) -> list[float]:
    """Seconds from connecting to the lane to the HELLO's answer, for `count` fresh sessions."""
    times = []
    for _ in spread(count, span):
        session = conn.session("hello-timing")
        start = time.perf_counter()
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(10)
            sock.connect(session.reply.lane_socket)
            sock.send(frames.hello(1, session.id, session.key, None))
            _, status, _, body = frames.split(sock.recv(frames.MAX_FRAME))
        times.append(time.perf_counter() - start)
        assert status == 0, bytes(body).decode()
    return times


def bound(baseline: list[float]) -> float:
    """Generous: far above a loaded machine's attach, far below one first-message deadline
    (1 s) of a silent peer, let alone the old 5 s per 16 of them."""
    return max(0.8, 20 * statistics.median(baseline))


def report(what: str, baseline: list[float], loaded: list[float]) -> None:
    print(f"\n{what}: baseline p50 {statistics.median(baseline) * 1e3:.1f} ms max {max(baseline) * 1e3:.1f} ms; "
          f"loaded p50 {statistics.median(loaded) * 1e3:.1f} ms max {max(loaded) * 1e3:.1f} ms")


def refused(daemon, socket_name: str, reason: str) -> float:
    _, families = scrape(daemon.metrics_port)
    found = samples(families, "kvtier_local_connections_refused_total", socket=socket_name, reason=reason)
    return sum(s.value for s in found)


@pytest.mark.parametrize("count", [48, 200])
def test_silent_handoff_connections_of_the_same_uid_do_not_delay_an_attach(daemon, silent, count):
    conn = Conn(daemon.target)
    try:
        baseline = attach_times(conn, 5)
        hostile = silent(f"{daemon.socket}.handoff", count)
        loaded = attach_times(conn, 20, SPAN_S)
        ended = hostile.stop()
        report(f"attach with {count} silent handoff connections (same uid)", baseline, loaded)
        assert max(loaded) < bound(baseline), (baseline, loaded)
        assert ended["ended"] >= count  # each was dropped at its deadline (and opened again)
        assert refused(daemon, "handoff", "deadline") >= count
    finally:
        conn.close()


@pytest.mark.skipif(not other_uid_possible(), reason="needs root to run a process as another uid")
def test_another_uid_is_refused_past_its_limit_and_ours_is_served(daemon, silent):
    conn = Conn(daemon.target)
    try:
        baseline = attach_times(conn, 5)
        hostile = silent(f"{daemon.socket}.handoff", PER_UID + 100, OTHER_UID)
        loaded = attach_times(conn, 20, SPAN_S)
        ended = hostile.stop()
        report(f"attach with {PER_UID + 100} silent handoff connections (another uid)", baseline, loaded)
        assert max(loaded) < bound(baseline), (baseline, loaded)
        assert ended["answered"] >= 100  # the ones past its limit were told why at once
        assert refused(daemon, "handoff", "uid_limit") >= 100
    finally:
        conn.close()


@pytest.mark.skipif(not other_uid_possible(), reason="needs root to run a process as another uid")
def test_another_uids_silent_lane_connections_leave_the_lane_to_us(daemon, silent):
    """Before: 512 lane connections in all, whoever held them; a uid holding them all
    left every other client on gRPC."""
    conn = Conn(daemon.target)
    try:
        baseline = hello_times(conn, 5)
        hostile = silent(f"{daemon.socket}.lane", 600, OTHER_UID)
        loaded = hello_times(conn, 20, SPAN_S)
        hostile.stop()
        report("lane HELLO with 600 silent lane connections (another uid)", baseline, loaded)
        assert max(loaded) < bound(baseline), (baseline, loaded)
        assert refused(daemon, "lane", "uid_limit") >= 600 - PER_UID
    finally:
        conn.close()


def test_silent_lane_connections_of_the_same_uid_do_not_delay_a_hello(daemon, silent):
    conn = Conn(daemon.target)
    try:
        baseline = hello_times(conn, 5)
        hostile = silent(f"{daemon.socket}.lane", 48)
        loaded = hello_times(conn, 20, SPAN_S)
        hostile.stop()
        report("lane HELLO with 48 silent lane connections (same uid)", baseline, loaded)
        assert max(loaded) < bound(baseline), (baseline, loaded)
        assert refused(daemon, "lane", "deadline") >= 48
    finally:
        conn.close()


def test_past_its_limit_a_uid_is_refused_at_once_and_a_silent_peer_is_told_why(daemons):
    """The two options set: 4 connections per uid, 2 s to speak (the refusals below come
    long before the 4 held connections' deadline)."""
    d = daemons.start("--local-connections-per-uid", "4", "--local-first-message-timeout", "2s", disk_size="0")
    path = f"{d.socket}.handoff"
    conn = Conn(d.target)
    reply = conn.call("Register", register_request("limits"))
    held = [socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(4)]
    try:
        for sock in held:
            sock.settimeout(10)
            sock.connect(path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as fifth:
            fifth.settimeout(10)
            fifth.connect(path)
            refusal = json.loads(fifth.recv(65536))  # at once: before it even spoke
        assert refusal["code"] == "UNAVAILABLE", refusal
        assert f"uid {os.getuid()} has 4 connections open" in refusal["message"]
        assert "local_connections_per_uid" in refusal["message"]
        with pytest.raises(Unavailable):
            attach(path, reply.session_id, None)
        for sock in held:  # each silent one is dropped at its deadline, and told why
            dropped = json.loads(sock.recv(65536))
            assert dropped["code"] == "DEADLINE_EXCEEDED" and "no request within 2s" in dropped["message"]
            assert sock.recv(65536) == b""
        os.close(attach(path, reply.session_id, None).arena_fd)  # the uid's places are free again
    finally:
        for sock in held:
            sock.close()
        conn.close()
