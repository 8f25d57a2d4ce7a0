"""KV events from real daemons (docs/events.md): a ZMQ SUB socket bound where the daemons
connect, as llm-d's indexer binds its own, reads vLLM event batches; WatchEvents streams
them over gRPC to the namespaces a token grants; token ids given at Commit (over gRPC and
over the fast lane) ride on every event of their blocks; and vLLM's own classes, in the
vLLM environment, decode what two daemons (two nodes) published into which blocks each
node holds in each tier, as the daemons themselves report it."""
from __future__ import annotations

import json
import queue
from array import array
import subprocess
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import grpc
import msgspec
import pytest
import zmq
from kvtier_client import KVTierClient, PageLayout, frames
from kvtier_client.errors import PermissionDenied, Unauthenticated
from kvtier_client.event_media import DEFAULT_MEDIA as MEDIUM
from kvtier_client.events import EventKind, EventStream, KVEvent
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.tiers import Tier
from kvtier_client.wire import tier_from_proto
from rpc import KVTIER, expect_code, free_port, scrape, value, wait_for

from kvtier.core.held import HeldCopy
from kvtier.events import EventPublisher, Topics

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16, dtype="float16")  # 3072-byte pages
BLOCK = LAYOUT.block_tokens
TOKEN_A = "token-a-6c1f0e9b2d7a4f3e8b5c1d0a9f8e7d6c"
TOKEN_B = "token-b-0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a"
TOKEN_ALL = "token-all-3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b"
WAIT = 10.0

# Run with .venv-vllm's Python: vLLM's own event classes decode every batch, and the
# BlockStored / BlockRemoved / AllBlocksCleared they yield say what each node holds.
VLLM_DECODER = textwrap.dedent(
    """
    import json, sys
    import msgspec
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    held = {}  # "<node>/<namespace>" -> medium -> {key hex: the block's token ids}
    for topic, payload in json.loads(sys.stdin.read()):
        _, node, namespace = topic.split("@")
        tiers = held.setdefault(node + "/" + namespace, {})
        for event in decoder.decode(bytes.fromhex(payload)).events:
            if isinstance(event, BlockStored):
                n = event.block_size
                for i, block_hash in enumerate(event.block_hashes):
                    tiers.setdefault(event.medium, {})[block_hash.hex()] = event.token_ids[i * n:(i + 1) * n]
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    del tiers[event.medium][block_hash.hex()]
            else:
                assert isinstance(event, AllBlocksCleared)
                tiers.clear()
    print(json.dumps(held))
    """
)


class Router:
    """A ZMQ SUB socket bound on loopback, subscribed to everything; the daemons connect to
    it (tcp://127.0.0.1:PORT has no wildcard, so they connect, as vLLM's publisher does,
    which they do only with --events-connect)."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.endpoint = f"tcp://127.0.0.1:{self.sub.bind_to_random_port('tcp://127.0.0.1')}"
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.messages: list[tuple[str, int, bytes]] = []  # (topic, seq, payload), as received

    def receive(self, seconds: float) -> None:
        """Take whatever arrives for `seconds`."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.sub.poll(int(left * 1000)):
                topic, seq, payload = self.sub.recv_multipart()
                self.messages.append((topic.decode(), int.from_bytes(seq, "big"), payload))

    def of(self, topic: str) -> list[bytes]:
        """One topic's payloads, checked to be its whole stream so far: sequence 0, 1, 2..."""
        seqs = [seq for t, seq, _ in self.messages if t == topic]
        assert seqs == list(range(len(seqs))), f"{topic}: sequence numbers {seqs}"
        return [payload for t, _, payload in self.messages if t == topic]

    def close(self) -> None:
        self.sub.close(linger=0)
        self.context.term()


def blocks(payloads: list[bytes]) -> list[tuple]:
    """Every block of every event, decoded as plain msgpack (the map layout):
    (type, medium, locality, key, its parent, its token ids)."""
    out = []
    for payload in payloads:
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert rank == 0 and ts > 0
        for e in events:
            if e["type"] == "BlockStored":
                assert e["lora_id"] is None and e["lora_name"] is None
                parent, n = e["parent_block_hash"], e["block_size"]
                for i, key in enumerate(e["block_hashes"]):
                    out.append(("stored", e["medium"], e.get("locality"), key, parent, e["token_ids"][i * n:(i + 1) * n]))
                    parent = key
            elif e["type"] == "BlockRemoved":
                out += [("removed", e["medium"], e.get("locality"), key, None, []) for key in e["block_hashes"]]
            else:
                out.append((e["type"], None, None, None, None, []))
    return out


def warm_up(router: Router, node, token: str | None = None) -> None:
    """ZMQ drops what a publisher sends before the subscription reaches it: commit blocks of a
    throwaway namespace until the router hears one."""
    with KVTierClient(node.target, token=token, name="warm-up") as kv:
        kv.register("warm-up", LAYOUT)
        for i in range(100):
            with kv.borrow(1) as lease:
                kv.commit(lease, [i.to_bytes(16, "big")])
            router.receive(0.1)
            if any(t.endswith("@warm-up") for t, _, _ in router.messages):
                return
    raise AssertionError(f"the router never heard {node.target}")


def prompt(tag: int, blocks_: int) -> list[int]:
    return [tag * 10_000 + i for i in range(blocks_ * BLOCK)]


def commit(kv: KVTierClient, tokens: list[int], first: int, last: int, *, with_tokens: bool = True) -> list[bytes]:
    """Commit blocks first..last-1 of a prompt (each after its parent); returns their keys."""
    keys = kv.block_keys(tokens)
    with kv.borrow(last - first) as lease:
        kv.commit(lease, keys[first:last], parent=keys[first - 1] if first else None,
                  token_ids=tokens[first * BLOCK:last * BLOCK] if with_tokens else None)
    return keys[first:last]


class Watch:
    """A WatchEvents stream read on a thread, so a test can wait for its next event with a
    timeout."""

    def __init__(self, stream: EventStream) -> None:
        self.stream = stream
        self.events: queue.Queue[KVEvent] = queue.Queue()
        threading.Thread(target=lambda: [self.events.put(e) for e in stream], daemon=True).start()

    def next(self) -> KVEvent:
        return self.events.get(timeout=WAIT)


@pytest.fixture
def vllm_decoder():
    """vLLM's decoder, started before the daemons act (importing vLLM takes seconds)."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON.parent.parent} (scripts/setup_vllm.sh makes it)")
    proc = subprocess.Popen([str(VLLM_PYTHON), "-c", VLLM_DECODER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def router():
    listening = Router()
    yield listening
    listening.close()


@pytest.fixture(scope="module")
def node1(module_daemons, router):
    """Four host pages, write-through to disk, no authentication; LRU (the expected
    evictions below are in its order)."""
    metrics_port = free_port()
    daemon = module_daemons.start("--events", router.endpoint, "--events-connect", "--events-topic", "kv@node1@{namespace}",
                                  "--write-through", "--policy", "lru", "--metrics-port", str(metrics_port), name="node1",
                                  host_size="16KiB", disk_size="1MiB")
    daemon.metrics_port = metrics_port
    warm_up(router, daemon)
    return daemon


@pytest.fixture(scope="module")
def node2(module_daemons, router, tmp_path_factory):
    """Tokens on: A may use tenant-a and model-y, B tenant-b; only model-y (and the warm-up)
    go out on ZMQ."""
    tokens = tmp_path_factory.mktemp("tokens") / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = ["tenant-a", "model-y"]\n"{TOKEN_B}" = ["tenant-b"]\n'
                      f'"{TOKEN_ALL}" = ["*"]\n')
    daemon = module_daemons.start("--events", router.endpoint, "--events-connect", "--events-topic", "kv@node2@{namespace}",
                                  "--events-namespaces", "model-y,warm-up", "--tokens-file", str(tokens), "--policy", "lru",
                                  name="node2")
    warm_up(router, daemon, TOKEN_ALL)
    return daemon


def test_batches_carry_each_chain_with_its_token_ids_over_the_lane_and_grpc(node1, router):
    tokens = prompt(1, 6)
    with KVTierClient(node1.target) as lane, KVTierClient(node1.target, lane=False) as grpc_only:
        for kv in (lane, grpc_only):
            kv.register("model-a", LAYOUT)
        assert (lane.transport, grpc_only.transport) == ("lane", "grpc")
        keys = commit(lane, tokens, 0, 3) + commit(grpc_only, tokens, 3, 5) + commit(lane, tokens, 5, 6, with_tokens=False)

    def stored(medium: str) -> list[tuple]:
        return [b for b in blocks(router.of("kv@node1@model-a")) if b[:2] == ("stored", medium)]

    wait_for(lambda: router.receive(0.05) or len(stored("DISK")) == 6, WAIT, "six blocks written to disk")
    expected = [(keys[i], keys[i - 1] if i else None, tokens[i * BLOCK:(i + 1) * BLOCK] if i < 5 else [])
                for i in range(6)]
    for medium in ("CPU", "DISK"):  # host, then disk (write-through)
        found = stored(medium)
        assert [(key, parent, ids) for _, _, _, key, parent, ids in found] == expected
        assert {locality for _, _, locality, _, _, _ in found} == {None}  # this node's own tiers, as vLLM's GPU events
    # Four host pages: storing six evicted two from host, never from disk.
    removed = [b for b in blocks(router.of("kv@node1@model-a")) if b[0] == "removed"]
    assert {(b[1], b[3]) for b in removed} == {("CPU", keys[0]), ("CPU", keys[1])}
    _, families = scrape(node1.metrics_port)
    assert value(families, "kvtier_events_published_total") >= 6 * 2 + 2
    assert value(families, "kvtier_events_dropped_total", where="buffer") == 0


def test_token_ids_are_checked_before_anything_changes(node1, connect):
    with KVTierClient(node1.target) as kv:
        kv.register("model-b", LAYOUT)
        keys = kv.block_keys(prompt(2, 2))
        lease = kv.borrow(2)
        with pytest.raises(ValueError, match="pass 16 per key"):
            kv.commit(lease, keys, token_ids=prompt(2, 1))
        with pytest.raises(ValueError, match="0 to 2\\*\\*32 - 1"):
            kv.commit(lease, keys, token_ids=[-1] * 32)
        # The daemon checks too: a raw request with the wrong count changes nothing.
        session = connect(node1.target).session("model-b")
        grant = session.borrow(2)
        message = expect_code(grpc.StatusCode.INVALID_ARGUMENT, session.call, "Commit", pb.CommitRequest(
            session_id=session.id, lease_id=grant.lease_id, keys=keys, token_ids=prompt(2, 1)))
        assert "16 token ids for 2 keys; pass 16 per key" in message
        assert session.commit(grant.lease_id, keys).committed == 2  # the lease is still open
        assert kv.commit(lease, keys, token_ids=prompt(2, 2)).duplicates == (0, 1)


def test_watch_events_shows_only_the_namespaces_a_token_grants_and_zmq_only_the_listed_ones(node2, router):
    with (KVTierClient(node2.target, token=TOKEN_A) as a, KVTierClient(node2.target, token=TOKEN_B) as b,
          KVTierClient(node2.target) as anonymous):
        with pytest.raises(PermissionDenied, match="tenant-b"):
            a.watch_events(["tenant-a", "tenant-b"])
        with pytest.raises(Unauthenticated):
            anonymous.watch_events()
        watch_a, watch_b = Watch(a.watch_events()), Watch(b.watch_events(["tenant-b"]))
        try:
            a.register("tenant-a", LAYOUT)
            b.register("tenant-b", LAYOUT)
            b_keys = commit(b, prompt(3, 2), 0, 2)
            a_keys = commit(a, prompt(4, 1), 0, 1)  # after B's: A's stream would have B's first
            first = watch_a.next()
            assert (first.kind, first.namespace, first.tier, first.keys) == (EventKind.STORED, "tenant-a", Tier.HOST,
                                                                          tuple(a_keys))
            assert first.token_ids == tuple(prompt(4, 1)) and first.block_size == BLOCK and first.parent is None
            seen_b = watch_b.next()
            assert (seen_b.namespace, seen_b.keys, seen_b.token_ids) == ("tenant-b", tuple(b_keys), tuple(prompt(3, 2)))
            time.sleep(0.2)  # anything else would be here by now
            assert {e.namespace for e in list(watch_a.events.queue)} <= {"tenant-a"}
            assert {e.namespace for e in list(watch_b.events.queue)} <= {"tenant-b"}
            assert watch_a.stream.missed == watch_b.stream.missed == 0
            # On ZMQ, tenant-a and tenant-b are not on node2's list: their events went to
            # WatchEvents only. ZMQ is fed before the watchers, in the order committed.
            router.receive(0.2)
            assert not [t for t, _, _ in router.messages if t.startswith("kv@node2@tenant-")]
        finally:
            watch_a.stream.close()
            watch_b.stream.close()


def test_commit_frames_carry_token_ids_only_with_their_flag():
    keys_ = [b"k" * 16, b"l" * 16]
    old = frames.commit(7, 42, keys_, b"p" * 16)  # as clients sent it before token ids existed
    op, flags, seq, body = frames.split(old)
    assert (op, flags, seq) == (frames.Op.COMMIT, 0, 7)
    assert frames.read_commit(flags, body) == (42, b"p" * 16, keys_, None)
    op, flags, seq, body = frames.split(frames.commit(8, 42, keys_, None, array("I", range(32))))
    assert flags == frames.TOKENS and old.startswith(frames.header(frames.Op.COMMIT, 7))
    lease_id, parent, got, token_ids = frames.read_commit(flags, body)
    assert (lease_id, parent, got, list(token_ids)) == (42, None, keys_, list(range(32)))
    with pytest.raises(frames.FrameError, match="token ids are cut short"):
        frames.read_commit(flags, body[:-1])
    with pytest.raises(frames.FrameError, match="bytes after the end"):
        frames.read_commit(0, body)  # token ids without the flag


def test_kvtier_events_command_prints_them_live(node1):
    proc = subprocess.Popen([*KVTIER, "events", "--target", node1.target, "--namespace", "model-c", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "watching KV events of model-c" in proc.stderr.readline()
        with KVTierClient(node1.target) as kv:
            kv.register("model-c", LAYOUT)
            keys = commit(kv, prompt(5, 1), 0, 1)
        event = json.loads(proc.stdout.readline())
        assert event["kind"] == "stored" and event["namespace"] == "model-c" and event["tier"] == "host"
        assert event["keys"] == [keys[0].hex()] and event["token_ids"] == prompt(5, 1) and event["block_size"] == BLOCK
    finally:
        proc.kill()
        proc.wait()


def test_array_layout_close_and_slow_watchers_in_process():
    """The publisher on its own: the positional layout llm-d parses, the cluster tier under
    the shared topic, a watcher that falls behind, and the host copies taken back at close."""
    with tempfile.TemporaryDirectory(dir="/tmp") as directory:  # an ipc:// path must be short
        endpoint = f"ipc://{directory}/events"
        publisher = EventPublisher(endpoint, topics=Topics("kv@pod-1@{namespace}", "kv@shared@{namespace}"),
                                   layout="array")
        context = zmq.Context()
        sub = context.socket(zmq.SUB)
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        held = [HeldCopy(Tier.HOST, "ns", b"k1", None, (1, 2))]
        sink = publisher.sink(2, lambda namespace: held)
        try:
            for _ in range(100):  # until the subscription is in place
                sink.removed(Tier.HOST, "warm-up", b"w")
                if sub.poll(50):
                    break
            told = []  # the subscription was heard: the whole state (what `held` says) was told
            while sub.poll(300):
                topic, seq, payload = sub.recv_multipart()
                told += [(topic, seq, e) for e in msgspec.msgpack.decode(payload)[1]]
            # Told as state: two removals, then the store (routers count stores).
            assert [e for t, _, e in told if t == b"kv@pod-1@ns"][-3:] == [
                ["BlockRemoved", [b"k1"], "CPU", None, None, "kvtier"],
                ["BlockRemoved", [b"k1"], "CPU", None, None, "kvtier"],
                ["BlockStored", [b"k1"], None, [1, 2], 2, None, "CPU", None, None, None, None, None, None, "kvtier"]]
            last_seq = max(int.from_bytes(q, "big") for t, q, _ in told if t == b"kv@pod-1@ns")
            slow = publisher.watch(lambda namespace: namespace == "ns")
            slow.capacity = 1  # block events it may have waiting
            sink.stored(Tier.HOST, "ns", b"k1", None, (1, 2))
            sink.removed(Tier.DISK, "ns", b"k0")
            sink.stored(Tier.CLUSTER, "ns", b"k2", b"k1", None)
            events, seqs = [], []
            while len(events) < 3:
                topic, seq, payload = sub.recv_multipart()
                if topic == b"kv@pod-1@warm-up":
                    continue
                assert topic == (b"kv@shared@ns" if len(events) == 2 else b"kv@pod-1@ns")  # the cluster is shared
                seqs.append(int.from_bytes(seq, "big"))
                events += msgspec.msgpack.decode(payload)[1]
            assert seqs == [last_seq + 1, 0]  # per topic, after the state told on subscribing
            # llm-d's engineadapter/vllm_adapter.go reads these positions: tag, hashes, parent,
            # token ids, block size, lora id, medium, lora name, extra keys, group, kind, window;
            # Dynamo's zmq_wire then locality and ownership.
            assert events == [
                ["BlockStored", [b"k1"], None, [1, 2], 2, None, "CPU", None, None, None, None, None, None, "kvtier"],
                ["BlockRemoved", [b"k0"], "DISK", None, None, "kvtier"],
                ["BlockStored", [b"k2"], b"k1", [], 2, None, "SHARED_STORAGE", None, None, None, None, None, "REMOTE",
                 "kvtier"],
            ]
            kept = missed = 0
            while kept + missed < 3:
                events, lost = slow.next()
                kept, missed = kept + sum(len(e.keys) for e in events), missed + lost
            assert kept <= 1 and kept + missed == 3  # at most one waits; the rest were dropped and counted
        finally:
            publisher.close()
            last = {}
            while sub.poll(2000):
                topic, _, payload = sub.recv_multipart()
                last[topic] = msgspec.msgpack.decode(payload)[1]
                if topic == b"kv@pod-1@ns":
                    break
            sub.close(linger=0)
            context.term()
        assert last[b"kv@pod-1@ns"] == [["BlockRemoved", [b"k1"], "CPU", None, None, "kvtier"]]  # what it held
        assert slow.next() is None  # the watch ended with the publisher
        stats = publisher.stats()
        assert (stats.dropped, stats.watchers, stats.watcher_missed) == (0, 0, missed)


def test_vllm_reads_which_blocks_each_node_holds_in_each_tier(vllm_decoder, node1, node2, router, connect):
    x, y = prompt(6, 6), prompt(7, 2)
    with KVTierClient(node1.target) as kv1, KVTierClient(node2.target, token=TOKEN_A, lane=False) as kv2:
        kv1.register("model-x", LAYOUT)
        kv2.register("model-y", LAYOUT)
        x_keys = commit(kv1, x, 0, 3) + commit(kv1, x, 3, 6)  # four host pages: two of x go (they stay on disk)
        y_keys = commit(kv2, y, 0, 2)
        x_tiers = [b.tier for b in kv1.explain(x_keys).blocks]  # the fastest copy of each, as the daemon says
        y_tiers = [b.tier for b in kv2.explain(y_keys).blocks]
    truth = {("node1", "model-x"): connect(node1.target), ("node2", "model-y"): connect(node2.target, token=TOKEN_A)}

    def pages(node: str, namespace: str) -> dict[str, int]:
        """Each tier's pages of the namespace, as the daemon counts them."""
        state = truth[(node, namespace)].state()
        return {MEDIUM[tier_from_proto(t.tier)]: t.pages for p in state.pools for ns in p.namespaces
                if ns.namespace == namespace for t in ns.tiers if t.pages}

    def held(node: str, namespace: str) -> dict[str, int]:
        """The same, from the events: a copy counts from its BlockStored to its BlockRemoved."""
        copies: dict[str, set] = {}
        for kind, medium, _, key, _, _ in blocks(router.of(f"kv@{node}@{namespace}")):
            if kind == "stored":
                copies.setdefault(medium, set()).add(key)
            else:
                copies.setdefault(medium, set()).discard(key)
        return {medium: len(keys) for medium, keys in copies.items() if keys}

    for node, namespace in truth:  # until every event is in (disk writes on node2 come in the background)
        wait_for(lambda: router.receive(0.05) or pages(node, namespace) == held(node, namespace), WAIT,
                 f"the events of {node}/{namespace} to add up to its stats")
    sent = [(topic, payload.hex()) for topic, _, payload in router.messages
            if topic in ("kv@node1@model-x", "kv@node2@model-y")]
    out, err = vllm_decoder.communicate(json.dumps(sent), timeout=60)
    assert vllm_decoder.returncode == 0, err
    decoded = json.loads(out)
    for (node, namespace), keys, tiers, tokens in (("node1", "model-x"), x_keys, x_tiers, x), \
                                                  (("node2", "model-y"), y_keys, y_tiers, y):
        holding = {medium: blocks_ for medium, blocks_ in decoded[f"{node}/{namespace}"].items() if blocks_}
        assert {medium: len(b) for medium, b in holding.items()} == pages(node, namespace)
        for i, (key, tier) in enumerate(zip(keys, tiers)):
            fastest = next(m for m in ("CPU", "DISK") if key.hex() in holding.get(m, {}))
            assert fastest == MEDIUM[tier]
            assert all(ids == tokens[i * BLOCK:(i + 1) * BLOCK] for m in holding.values() if key.hex() in m
                       for ids in [m[key.hex()]])
    assert set(decoded["node1/model-x"]["CPU"]) == {k.hex() for k in x_keys[2:]}
    assert set(decoded["node1/model-x"]["DISK"]) == {k.hex() for k in x_keys}
