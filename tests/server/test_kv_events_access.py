"""Who reads the KV events a real daemon publishes over ZMQ (docs/events.md, "Security"):
with CurveZMQ only subscribers holding a listed key, whether the daemon binds or dials out;
without events_connect the daemon dials no one; with tokens it publishes no namespace it was
not told to. Plus the refusals of unusable key files, which name the option and the file.

Why the negative checks cannot pass by luck: every subscriber is connected before the
first event, and the one that may read is shown to have read the same events (on a PUB
socket every subscribed peer is sent every message, in order), so a peer that got nothing
was refused, not late."""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.auth
from kvtier_client import KVTierClient, PageLayout
from kvtier_client.errors import PermissionDenied
from rpc import KVTIER, free_port

from kvtier.events.access import parse_namespaces
from kvtier.events.curve import load_curve

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="this pyzmq's libzmq has no CURVE (libsodium)")

LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16, dtype="float16")
TOKEN_A = "token-a-5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e"
TOKEN_B = "token-b-9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b"
WAIT = 10.0


class Keys:
    """The daemon's certificate, a router's (listed in clients/) and a stranger's (not)."""

    def __init__(self, base: Path) -> None:
        for name in ("clients", "strangers"):
            (base / name).mkdir()
        self.server_public, self.server_secret = zmq.auth.create_certificates(base, "kvtier")
        _, self.router = zmq.auth.create_certificates(base / "clients", "router")
        _, self.stranger = zmq.auth.create_certificates(base / "strangers", "stranger")
        for secret in (self.server_secret, self.router, self.stranger):
            Path(secret).chmod(0o600)  # as docs/events.md says (pyzmq writes them with the umask)
        self.clients = base / "clients"
        self.options = ("--events-curve-secret-key-file", self.server_secret,
                        "--events-curve-clients-dir", str(self.clients))


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Keys:
    return Keys(tmp_path_factory.mktemp("curve"))


class Subscriber:
    """A SUB socket subscribed to everything: CURVE with `certificate` (None: plain ZMQ),
    bound or connected; it keeps every topic it hears."""

    def __init__(self, context: zmq.Context, endpoint: str, certificate: str | None, keys: Keys, *, bind: bool = False):
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        if certificate is not None:
            self.sub.curve_publickey, self.sub.curve_secretkey = zmq.auth.load_certificate(certificate)
            self.sub.curve_serverkey = zmq.auth.load_certificate(keys.server_public)[0]
        (self.sub.bind if bind else self.sub.connect)(endpoint)
        self.heard: list[tuple[str, list]] = []  # (topic, events)

    def drain(self) -> None:
        """Take what has arrived (a bound SUB also attaches new peers only when used)."""
        while self.sub.poll(0):
            topic, _, payload = self.sub.recv_multipart()
            self.heard.append((topic.decode(), msgspec.msgpack.decode(payload)[1]))

    def topics(self) -> set[str]:
        return {topic for topic, _ in self.heard}

    def token_ids(self, namespace: str) -> list[int]:
        return [i for topic, events in self.heard if topic.endswith("@" + namespace) for e in events
                for i in e.get("token_ids", [])]


def commit(target: str, namespace: str, tag: int, *, token: str | None = None) -> list[int]:
    """One block of `namespace` with its token ids; returns them."""
    tokens = [tag * 1000 + i for i in range(LAYOUT.block_tokens)]
    with KVTierClient(target, token=token, name="committer") as kv:
        kv.register(namespace, LAYOUT)
        with kv.borrow(1) as lease:
            kv.commit(lease, kv.block_keys(tokens), token_ids=tokens)
    return tokens


def until_heard(daemon, reader: Subscriber, others: list[Subscriber], namespace: str, *, token: str | None = None) -> None:
    """Commit blocks of `namespace` until `reader` hears one (ZMQ drops what is sent before a
    subscription is in place), draining everyone meanwhile."""
    deadline = time.monotonic() + WAIT
    tag = 0
    while time.monotonic() < deadline:
        tag += 1
        commit(daemon.target, namespace, tag, token=token)
        end = time.monotonic() + 0.1
        while time.monotonic() < end:
            for s in (reader, *others):
                s.drain()
            if any(t.endswith("@" + namespace) for t in reader.topics()):
                return
            time.sleep(0.01)
    raise AssertionError(f"no {namespace} events reached the listed subscriber in {WAIT}s")


def test_curve_lets_in_only_listed_keys(daemons, keys):
    port = free_port()
    daemon = daemons.start("--events", f"tcp://*:{port}", *keys.options)
    context = zmq.Context()
    try:
        endpoint = f"tcp://127.0.0.1:{port}"
        router = Subscriber(context, endpoint, keys.router, keys)
        plain = Subscriber(context, endpoint, None, keys)
        stranger = Subscriber(context, endpoint, keys.stranger, keys)
        until_heard(daemon, router, [plain, stranger], "warm-up")
        tokens = commit(daemon.target, "model-a", 99)
        until_heard(daemon, router, [plain, stranger], "model-a")
        assert router.token_ids("model-a")[:len(tokens)] == tokens  # the listed key reads the prompt
        time.sleep(0.2)
        for s in (plain, stranger):
            s.drain()
        assert plain.heard == [] and stranger.heard == []
    finally:
        context.destroy(linger=0)


def test_dialling_out_with_curve_sends_nothing_to_a_listener_without_a_listed_key(daemons, keys, tmp_path):
    """Whoever binds the address first: a stranger holding the port gets nothing; once the
    router holds it, the same daemon's events reach the router."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    context, first = zmq.Context(), zmq.Context()
    try:
        stranger = Subscriber(first, endpoint, keys.stranger, keys, bind=True)
        daemon = daemons.start("--events", endpoint, "--events-connect", *keys.options)
        for tag in range(10):
            commit(daemon.target, "model-b", tag)
            stranger.drain()
            time.sleep(0.1)
        stranger.drain()
        assert stranger.heard == []
        first.destroy(linger=0)  # returns once its sockets are closed: the port is free
        router = Subscriber(context, endpoint, keys.router, keys, bind=True)  # the daemon reconnects to it
        until_heard(daemon, router, [], "model-b")
    finally:
        first.destroy(linger=0)
        context.destroy(linger=0)


def test_connect_mode_is_refused_without_events_connect(tmp_path, keys):
    """A connect-mode endpoint without the opt-in: the daemon refuses to start, naming the
    option, and the listener there hears nothing."""
    context = zmq.Context()
    try:
        port = free_port()
        listener = Subscriber(context, f"tcp://127.0.0.1:{port}", None, keys, bind=True)
        proc = launch_refused(tmp_path, "--events", f"tcp://127.0.0.1:{port}")
        listener.drain()
        assert "events_connect = true (--events-connect)" in proc
        assert listener.heard == []
    finally:
        context.destroy(linger=0)


def launch_refused(tmp_path: Path, *args: str) -> str:
    """Run `kvtier serve ARGS`, expect exit 2 (a configuration refused) and return stderr."""
    socket = tmp_path / "run" / "kvtier.sock"
    out = subprocess.run([*KVTIER, "serve", "--socket", str(socket), "--cache-dir", str(tmp_path / "cache"),
                          "--host-size", "1MiB", "--disk-size", "0", "--warm-restart-window", "0", *args],
                         capture_output=True, text=True, timeout=20)
    assert out.returncode == 2, f"exit {out.returncode}: {out.stdout}{out.stderr}"
    return out.stderr


def test_with_tokens_the_daemon_publishes_only_listed_namespaces(daemons, tmp_path, keys):
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text(f'[tokens]\n"{TOKEN_A}" = ["tenant-a", "warm-up"]\n"{TOKEN_B}" = ["tenant-b"]\n')
    refused = launch_refused(tmp_path / "refused", "--events", "tcp://*:0", "--tokens-file", str(tokens_file))
    assert "events_namespaces (--events-namespaces a,b), or * for all" in refused
    port = free_port()
    daemon = daemons.start("--events", f"tcp://*:{port}", "--events-namespaces", "tenant-a,warm-up",
                           "--tokens-file", str(tokens_file))
    context = zmq.Context()
    try:
        sub = Subscriber(context, f"tcp://127.0.0.1:{port}", None, keys)
        until_heard(daemon, sub, [], "warm-up", token=TOKEN_A)
        with KVTierClient(daemon.target, token=TOKEN_B) as b, b.watch_events(["tenant-b"]) as stream:
            b_tokens = commit(daemon.target, "tenant-b", 7, token=TOKEN_B)  # before A's: on ZMQ it would come first
            a_tokens = commit(daemon.target, "tenant-a", 8, token=TOKEN_A)
            until_heard(daemon, sub, [], "tenant-a", token=TOKEN_A)
            assert sub.token_ids("tenant-a")[:len(a_tokens)] == a_tokens
            assert not [t for t in sub.topics() if t.endswith("@tenant-b")]
            event = next(iter(stream))  # WatchEvents still gives B its own namespace
            assert event.namespace == "tenant-b" and event.token_ids == tuple(b_tokens)
        with KVTierClient(daemon.target, token=TOKEN_B) as b, pytest.raises(PermissionDenied):
            b.watch_events(["tenant-a"])
    finally:
        context.destroy(linger=0)


def test_refusals_name_the_option_and_the_file(tmp_path, keys):
    """Each unusable key file is refused at start, by the daemon and by the loader."""
    stderr = launch_refused(tmp_path, "--events", "tcp://*:0", "--events-curve-secret-key-file",
                            str(tmp_path / "nowhere.key_secret"), "--events-curve-clients-dir", str(keys.clients))
    assert f"events_curve_secret_key_file {tmp_path / 'nowhere.key_secret'} cannot be read" in stderr
    garbage = tmp_path / "garbage.key_secret"
    garbage.write_text("not a certificate\n")
    short = tmp_path / "short.key_secret"
    short.write_text('curve\n    public-key = "abc"\n    secret-key = "def"\n')
    mixed = tmp_path / "mixed.key_secret"  # two key pairs' halves
    mixed.write_text(f'curve\n    public-key = "{zmq.curve_keypair()[0].decode()}"\n'
                     f'    secret-key = "{zmq.curve_keypair()[1].decode()}"\n')
    empty = tmp_path / "empty"
    empty.mkdir()
    bad_clients = tmp_path / "bad-clients"
    shutil.copytree(keys.clients, bad_clients)
    (bad_clients / "broken.key").write_text('curve\n    public-key = "~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~"\n')
    clients = str(keys.clients)
    for secret, clients_dir, message in [
        (keys.server_secret, "", "events_curve_secret_key_file needs events_curve_clients_dir"),
        ("", clients, "events_curve_clients_dir needs events_curve_secret_key_file"),
        (str(garbage), clients, f"events_curve_secret_key_file {garbage} holds no public-key line"),
        (keys.server_public, clients, f"events_curve_secret_key_file {keys.server_public} holds a public key only"),
        (str(short), clients, f"events_curve_secret_key_file {short}: its public-key is not a CURVE key"),
        (str(mixed), clients, f"events_curve_secret_key_file {mixed}: its public-key is not the one of its secret-key"),
        (keys.server_secret, str(empty), f"events_curve_clients_dir {empty} holds no client certificate"),
        (keys.server_secret, str(tmp_path / "none"), f"events_curve_clients_dir {tmp_path / 'none'} is not a directory"),
        (keys.server_secret, str(bad_clients), f"events_curve_clients_dir {bad_clients / 'broken.key'}: its public-key "
                                               "is not a CURVE key"),
    ]:
        with pytest.raises(ValueError) as refused:
            load_curve(secret, clients_dir)
        assert message in str(refused.value)
    assert load_curve("", "") is None


@pytest.mark.parametrize("text, expected", [
    ("*", None), ("a", {"a"}), ("model-a, llama/tenant-b", {"model-a", "llama/tenant-b"}),
    ("a,,b", "has an empty name"), ("*,a", "mixes * (every namespace) with names"),
    ("['a', 'b']", "comma-separated in one string"),
])
def test_namespace_lists(text, expected):
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=re.escape(expected)):
            parse_namespaces(text)
    else:
        assert parse_namespaces(text) == (None if expected is None else frozenset(expected))
