"""KV event topics as routers credit them (docs/events.md, "Topics" and "Telling the whole
state"): a real daemon binds its ZMQ endpoint, a SUB socket here plays the router.

- a node-wide daemon publishes a namespace under the topic of every engine attached to it
  (each engine names its endpoint and served model at Register), tells a newly attached
  engine's topic the whole state, and takes it back from a departed engine's;
- the daemon's own identity (pod_ip, engine_port, events_models) names the topic when no
  engine does; the cluster tier has a topic of its own;
- a subscriber that joins late is told the whole state, parents first; a restarted daemon
  tells its disk pages again; host copies are taken back at a stop.
"""
from __future__ import annotations

import subprocess

import msgspec
import pytest
from event_subscriber import LAYOUT, Sub, commit, prompt
from kvtier_client import KVTierClient
from kvtier_client.errors import InvalidArgument
from rpc import KVTIER, wait_for

WAIT = 10.0


class Subscriber(Sub):
    """Everything the daemon sends, decoded: (topic, sequence, events)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.messages: list[tuple[str, int, list]] = []

    def receive(self, seconds: float = 0.05) -> None:
        for topic, seq, payload in self.frames(seconds):
            self.messages.append((topic.decode(), int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)[1]))

    def held(self, topic: str) -> dict[str, set[bytes]]:
        """What `topic` has been told it holds: medium -> keys (BlockStored minus BlockRemoved)."""
        seqs = [seq for t, seq, _ in self.messages if t == topic]  # consecutive from where it joined
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True, f"{topic}: sequence numbers {seqs}"
        copies: dict[str, set[bytes]] = {}
        for t, _, events in self.messages:
            for e in events if t == topic else ():
                assert e["ownership"] == "kvtier"
                keys = copies.setdefault(e["medium"], set())
                if e["type"] == "BlockStored":
                    keys.update(e["block_hashes"])
                else:
                    keys.difference_update(e["block_hashes"])
        return {medium: keys for medium, keys in copies.items() if keys}

    def stored_parents(self, topic: str) -> list[tuple[bytes | None, list[bytes]]]:
        return [(e["parent_block_hash"], e["block_hashes"]) for t, _, events in self.messages if t == topic
                for e in events if e["type"] == "BlockStored"]



@pytest.fixture
def subscribers(subs):
    return lambda endpoint: subs(Subscriber, endpoint)


def test_a_node_wide_daemon_credits_every_engine_attached_to_a_namespace(daemons, events_endpoint, subscribers):
    daemon = daemons.start("--events", events_endpoint, "--events-reannounce", "0", "--node-name", "node-7",
                           "--events-cluster-topic", "kv@pool@{model}")
    router = subscribers(events_endpoint)
    a_topic, b_topic, c_topic = ("kv@10.0.0.1:8000@llama", "kv@10.0.0.2:8000@llama", "kv@10.0.0.3:8001@llama")
    with (KVTierClient(daemon.target, engine_endpoint="10.0.0.1:8000", served_model="llama") as a,
          KVTierClient(daemon.target, engine_endpoint="10.0.0.2:8000", served_model="llama") as b):
        a.register("shared", LAYOUT)
        b.register("shared", LAYOUT)
        keys = commit(a, prompt(1, 3)) + commit(b, prompt(2, 2))
        wait_for(lambda: router.receive() or all(router.held(t) == {"CPU": set(keys)} for t in (a_topic, b_topic)),
                 WAIT, "both engines' topics to hold every page")
        # A third engine joins: its topic is told the whole state at once, parents first.
        with KVTierClient(daemon.target, engine_endpoint="10.0.0.3:8001", served_model="llama") as c:
            c.register("shared", LAYOUT)
            wait_for(lambda: router.receive() or router.held(c_topic) == {"CPU": set(keys)}, WAIT,
                     "the joined engine's topic to be told every page")
            told = router.stored_parents(c_topic)
            assert sorted(told) == sorted([(None, keys[:3]), (None, keys[3:])])  # two chains, each in order
        # It left: its topic is told the pages are gone; the others keep them.
        wait_for(lambda: router.receive() or router.held(c_topic) == {}, WAIT, "the departed engine's pages taken back")
        assert router.held(a_topic) == router.held(b_topic) == {"CPU": set(keys)}
    assert not [t for t, _, _ in router.messages if "node-7" in t or t.startswith("kv@pool@")]


def test_the_daemons_own_identity_names_the_topic_when_no_engine_does(daemons, events_endpoint, subscribers):
    daemon = daemons.start("--events", events_endpoint, "--pod-ip", "10.1.2.3", "--engine-port", "8200",
                           "--events-models", "vllm/llama=meta-llama/Llama-3.1-8B", "--events-media", "host=HOST_RAM")
    router = subscribers(events_endpoint)
    with KVTierClient(daemon.target) as kv:
        kv.register("vllm/llama", LAYOUT)
        keys = commit(kv, prompt(3, 2))
        topic = "kv@10.1.2.3:8200@meta-llama/Llama-3.1-8B"
        wait_for(lambda: router.receive() or router.held(topic) == {"HOST_RAM": set(keys)}, WAIT,
                 "the pod's own topic to hold the pages")
    # The engine in the pod names its served model (the vLLM connector does): that names the topic.
    with KVTierClient(daemon.target, served_model="org/x") as kv:
        kv.register("vllm/x", LAYOUT)
        keys = commit(kv, prompt(6, 1))
        wait_for(lambda: router.receive() or router.held("kv@10.1.2.3:8200@org/x") == {"HOST_RAM": set(keys)}, WAIT,
                 "the engine's own model to name the topic")
        with pytest.raises(InvalidArgument, match="IP:PORT"):
            KVTierClient(daemon.target, engine_endpoint="no-port").register("vllm/llama", LAYOUT)
        with pytest.raises(InvalidArgument, match="'@'"):
            KVTierClient(daemon.target, engine_endpoint="10.0.0.1:8000", served_model="a@b").register("x", LAYOUT)


def test_late_subscribers_and_restarts_are_told_the_whole_state(daemons, events_endpoint, subscribers, tmp_path):
    args = ("--events", events_endpoint, "--pod-ip", "10.0.0.9", "--events-models", "m=model", "--write-through",
            "--events-reannounce", "0", "--warm-restart-window", "0")
    daemon = daemons.start(*args, name="restart")
    topic = "kv@10.0.0.9:8000@model"
    with KVTierClient(daemon.target) as kv:
        kv.register("m", LAYOUT)
        keys = commit(kv, prompt(4, 4))
        early = subscribers(events_endpoint)
        wait_for(lambda: early.receive() or early.held(topic) == {"CPU": set(keys), "DISK": set(keys)}, WAIT,
                 "a subscriber joining after the commits to be told host and disk copies")
        # Parents first: the chain is told in one event per tier, its first block a root.
        assert sorted(early.stored_parents(topic)) == [(None, keys), (None, keys)]
    assert daemon.stop() == 0
    early.receive(0.5)
    assert early.held(topic) == {}  # taken back at the stop: nothing is served until the next daemon
    again = daemons.start(*args, name="restart")
    late = subscribers(events_endpoint)
    late.receive(0.5)  # subscribed; the layout's pool opens (and reads its disk pages) at its first Register
    with KVTierClient(again.target) as kv:
        kv.register("m", LAYOUT)
        wait_for(lambda: late.receive() or late.held(topic) == {"DISK": set(keys)}, WAIT,
                 "the restarted daemon to tell its disk pages")


def test_periodic_reannounce_repeats_the_state(daemons, events_endpoint, subscribers):
    daemon = daemons.start("--events", events_endpoint, "--events-reannounce", "1s", "--pod-ip", "10.0.0.4")
    router = subscribers(events_endpoint)
    with KVTierClient(daemon.target) as kv:
        kv.register("ns", LAYOUT)
        keys = commit(kv, prompt(5, 2))
        topic = "kv@10.0.0.4:8000@ns"

        def told_again() -> bool:
            router.receive(0.1)
            return sum(e["block_hashes"] == keys for t, _, events in router.messages if t == topic
                       for e in events if e["type"] == "BlockStored") >= 2

        wait_for(told_again, WAIT, "the state told again by the timer")


def test_topics_media_and_models_are_checked_at_start(tmp_path):
    for flags, message in ((("--events-topic", "kv@{nope}"), "not a template"),
                           (("--events-media", "tape=TAPE"), "unknown tier"),
                           (("--events-models", "just-a-name"), "NAMESPACE=MODEL")):
        done = subprocess.run([*KVTIER, "serve", "--socket", str(tmp_path / "kvtier.sock"), "--cache-dir",
                               str(tmp_path / "cache"), "--events", "watch", *flags],
                              check=False, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr + done.stdout, (flags, done.stderr)
