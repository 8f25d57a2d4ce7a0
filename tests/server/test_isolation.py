"""Memory per namespace as a capability, and sessions bound to their credentials, tried from
outside against a real daemon (tokens on), a real tenant process and a real attacker
process of another uid (docs/security.md).

Tenant A runs as root in its own process and holds pages full of a secret. The attacker
runs as another uid (it drops privileges after loading Python) with the socket's group, as
an engine container of another tenant would: it may use the daemon's sockets, and tries
every path it can see to A's memory: /dev/shm, /proc/<pid>/{fd,map_files,mem} of the
daemon, its arena keeper and tenant A, the keeper's socket, attaching A's session, and its
own namespace's arena.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import grpc
import pytest
from daemon import keeper_socket, start_daemon, stop_keeper
from kvtier_client.errors import PermissionDenied
from kvtier_client.handoff import attach
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import LAYOUT, Conn, expect_code, free_port, keys, register_request

Code = grpc.StatusCode
TOKEN_A = "token-a-6c1f0e9b2d7a4f3e8b5c1d0a9f8e7d6c"
TOKEN_B = "token-b-0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a"
SECRET = bytes.fromhex("5ec2e75ec2e75ec2e75ec2e75ec2e7aa")  # 16 bytes, repeated over each of A's pages
ATTACKER_UID = 65532

TENANT = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    from kvtier_client import KVTierClient, PageLayout
    target, token, secret = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
    layout = PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16)
    with KVTierClient(target, token=token, name="tenant-a") as kv:
        kv.register("tenant-a", layout)
        with kv.borrow(4) as lease:
            for page in lease.pages:
                raw = page.view(np.uint8).reshape(-1)
                raw[:] = np.frombuffer(secret * (raw.size // len(secret)), np.uint8)
            lease.commit([bytes([i]) * 16 for i in range(4)])
        print(json.dumps({"session": kv.pool.session_id, "pid": os.getpid()}), flush=True)
        sys.stdin.read()  # hold the session (and the mapping) until the test is done
    """
)

ATTACKER = textwrap.dedent(
    """
    import array, json, mmap, os, socket, sys  # array: socket.recv_fds imports it, after the uid switch it could not
    from kvtier_client import frames
    from kvtier_client.errors import KVTierError, from_status
    from kvtier_client.handoff import attach
    job = json.loads(sys.argv[1])
    secret = bytes.fromhex(job["secret"])
    os.setgroups([])
    os.setgid(0)  # the socket's group, as a sidecar volume grants it
    os.setuid(job["uid"])
    found = {"reached": [], "refused": {}}

    def refused(what, call):
        try:
            call()
        except (OSError, KVTierError) as exc:
            found["refused"][what] = type(exc).__name__
        else:
            found["reached"].append(what)

    for name in os.listdir("/dev/shm"):
        try:
            with open(os.path.join("/dev/shm", name), "rb") as f:
                if secret in f.read():
                    found["reached"].append("/dev/shm/" + name)
        except OSError:
            pass
    for pid in job["pids"]:
        for part in ("fd", "map_files"):
            refused(f"/proc/{pid}/{part}", lambda: [open(os.path.join(f"/proc/{pid}/{part}", e), "rb").close()
                                                      for e in os.listdir(f"/proc/{pid}/{part}")])
        refused(f"/proc/{pid}/mem", lambda: open(f"/proc/{pid}/mem", "rb").close())
    keeper = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    refused("keeper socket", lambda: keeper.connect(job["keeper"]))
    refused("attach A's session with B's token", lambda: attach(job["handoff"], job["session_a"], job["token_b"]))
    refused("attach A's session with no token", lambda: attach(job["handoff"], job["session_a"], None))

    def lane_hello(session_id, token):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as lane:
            lane.settimeout(10)
            lane.connect(job["lane"])
            lane.send(frames.hello(1, session_id, "0" * 32, token))
            _, status, _, body = frames.split(lane.recv(frames.MAX_FRAME))
            if status:
                raise from_status(status, bytes(body).decode())

    refused("lane HELLO for A's session with B's token", lambda: lane_hello(job["session_a"], job["token_b"]))
    refused("lane HELLO for A's session with A's token", lambda: lane_hello(job["session_a"], job["token_a"]))
    own = attach(job["handoff"], job["session_b"], job["token_b"])  # its own session: allowed
    with mmap.mmap(own.arena_fd, own.arena_bytes, mmap.MAP_SHARED, mmap.PROT_READ) as arena:
        found["own arena has the secret"] = secret in arena[:]
        found["own arena bytes"] = len(arena)
    print(json.dumps(found))
    """
)


@pytest.fixture
def open_daemon():
    """A daemon (tokens on) under a directory the attacker's uid may traverse with the
    socket's group: as sockets shared with engine containers are."""
    base = Path(tempfile.mkdtemp(prefix="kvtier-isolation-"))
    os.chmod(base, 0o750)
    tokens = base / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = ["tenant-a"]\n"{TOKEN_B}" = ["tenant-b"]\n')
    daemon = start_daemon(base, "--tokens-file", str(tokens), "--session-timeout", "60s",
                          host_size="64KiB", disk_size="1MiB")
    try:
        for path in (daemon.socket.parent, daemon.cache_dir):
            os.chmod(path, 0o750)
        yield daemon
    finally:
        code = daemon.stop()
        left = stop_keeper(daemon)
        shutil.rmtree(base, ignore_errors=True)
        assert code == 0 and not left, daemon.log()


@pytest.fixture
def tenant_a(open_daemon):
    proc = subprocess.Popen([sys.executable, "-c", TENANT, open_daemon.target, TOKEN_A, SECRET.hex()],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        yield json.loads(line)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()


def _keeper_pid(daemon) -> int:
    path = str(keeper_socket(daemon))
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if b"kvtier.mechanism.keeper" in cmdline and path.encode() in cmdline:
            return int(entry)
    raise AssertionError(f"no keeper process for {path}")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_another_tenant_cannot_reach_a_namespaces_memory(open_daemon, tenant_a):
    conn_b = Conn(open_daemon.target, token=TOKEN_B)
    try:
        # Tenant B's session is registered here and attached by the attacker itself.
        reply_b = conn_b.call("Register", register_request("tenant-b", layout=LAYOUT, name="attacker"))
        job = {
            "uid": ATTACKER_UID, "secret": SECRET.hex(), "keeper": str(keeper_socket(open_daemon)),
            "handoff": reply_b.handoff_socket, "session_a": tenant_a["session"], "session_b": reply_b.session_id,
            "token_a": TOKEN_A, "token_b": TOKEN_B, "lane": reply_b.lane_socket, "pids": [open_daemon.proc.pid, _keeper_pid(open_daemon), tenant_a["pid"]],
        }
        out = subprocess.run([sys.executable, "-c", ATTACKER, json.dumps(job)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        found = json.loads(out.stdout)
    finally:
        conn_b.close()
    print("attacker:", json.dumps(found, indent=1))
    assert found["reached"] == [], f"the attacker reached tenant A's memory or metadata through {found['reached']}"
    assert found["refused"]["attach A's session with B's token"] == "PermissionDenied"
    assert found["refused"]["keeper socket"] == "PermissionError"
    assert found["refused"]["lane HELLO for A's session with B's token"] == "PermissionDenied"
    assert found["refused"]["lane HELLO for A's session with A's token"] == "PermissionDenied"
    assert found["own arena bytes"] > 0 and found["own arena has the secret"] is False


def test_a_session_id_is_useless_to_another_process(open_daemon, tenant_a):
    """Even with the very token that opened it, another process cannot use A's session: it
    lacks the key only the attaching process got, and cannot attach the session itself."""
    session = tenant_a["session"]
    thief = Conn(open_daemon.target, token=TOKEN_A)
    try:
        for method, request in (
            ("Heartbeat", pb.HeartbeatRequest(session_id=session)),
            ("Lookup", pb.LookupRequest(session_id=session, keys=[bytes([0]) * 16])),
            ("Borrow", pb.BorrowRequest(session_id=session, count=1)),
            ("CloseSession", pb.CloseSessionRequest(session_id=session)),
        ):
            for key in ("", "0" * 32):
                message = expect_code(Code.PERMISSION_DENIED, thief.call, method, request, key=key)
                assert session not in message  # ids are never echoed whole
        with pytest.raises(PermissionDenied, match="attached to another process"):
            attach(f"{open_daemon.socket}.handoff", session, TOKEN_A)
        # The session is untouched: its pages are still cached for tenant A.
        own = thief.session("tenant-a")
        assert own.lookup(keys("unrelated", 1)).hit_blocks == 0
        assert own.lookup([bytes([i]) * 16 for i in range(4)]).hit_blocks == 4
    finally:
        thief.close()


def test_tcp_sessions_carry_their_key_and_never_attach(daemons, connect, tmp_path):
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = ["tenant-a"]\n')
    port = free_port()
    d = daemons.start("--tokens-file", str(tokens), "--tcp", f"127.0.0.1:{port}", "--insecure")
    remote = Conn(f"127.0.0.1:{port}", token=TOKEN_A)
    try:
        s = remote.session("tenant-a")
        assert s.reply.handoff_socket == "" and len(s.key) == 32 and s.reply.host_arena_bytes == 0
        s.put(keys("tcp", 2))
        assert s.lookup(keys("tcp", 2)).hit_blocks == 2
        expect_code(Code.PERMISSION_DENIED, remote.call, "Lookup", pb.LookupRequest(session_id=s.id, keys=keys("tcp", 1)))
        with pytest.raises(PermissionDenied, match="over TCP"):
            attach(f"{d.socket}.handoff", s.id, TOKEN_A)
    finally:
        remote.close()
