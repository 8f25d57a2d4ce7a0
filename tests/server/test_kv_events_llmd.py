"""Does llm-d credit what kvtier holds? A real daemon publishes; every message it sends is fed
to tests/llmd_index.py, a model of llm-d's event pool, index and scorer (its golden hashes are
llm-d's own); then, block by block, the endpoints and tiers llm-d would credit are compared
with what the daemon says it holds (docs/events.md).

The llm-d side is a model, not llm-d's Go code: Go modules cannot be fetched here. It follows
llm-d-router's pkg/kvevents and pkg/kvcache, including the reference count of stores that
makes a plain repeated BlockStored outlive a block's eviction.
"""
from __future__ import annotations

import time

import pytest
from event_subscriber import BLOCK, LAYOUT, Sub, commit, prompt
from kvtier_client import KVTierClient
from kvtier_client.tiers import Tier
from llmd_index import LlmdIndex, configured_weights
from rpc import wait_for

MODEL = "Qwen/Qwen3-8B"
WAIT = 15.0
WEIGHTS = configured_weights()  # deploy/routers/, kvtier's configuration of llm-d's router


class Router(Sub):
    """An llm-d router in centralized mode, as far as events go: a SUB socket (connected to
    the daemon's bound endpoint here) whose every message goes through llm-d's event path."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint, b"kv@")  # llm-d's topicFilter
        self.index = LlmdIndex(block_size_tokens=BLOCK, weights=WEIGHTS)

    def receive(self, seconds: float = 0.05) -> None:
        for frames in self.frames(seconds):
            self.index.feed(*frames)

    def credited(self, tokens: list[int]) -> list[dict[str, set[str]]]:
        """For each block of a prompt, the endpoints llm-d credits and in which tiers."""
        return [self.index.pods_holding(key) for key in self.index.request_keys(MODEL, tokens)]



@pytest.fixture
def routers(subs):
    return lambda endpoint: subs(Router, endpoint)


def truth(kv: KVTierClient, tokens: list[int], pods: list[str]) -> list[dict[str, set[str]]]:
    """What the daemon holds of each block, as llm-d should credit it: written through, every
    block is on disk; those whose fastest copy is host are in host too."""
    blocks = kv.explain(kv.block_keys(tokens)).blocks
    tiers = [{"disk"} | ({"cpu"} if b.tier is Tier.HOST else set()) for b in blocks]
    return [dict.fromkeys(pods, t) for t in tiers]


def agrees(router: Router, kv: KVTierClient, prompts: list[list[int]], pods: list[str]) -> bool:
    router.receive()
    return all(router.credited(p) == truth(kv, p, pods) for p in prompts)


def test_llm_d_credits_each_page_to_its_engine_and_tier_through_repeats_and_evictions(daemons, events_endpoint, routers):
    daemon = daemons.start("--events", events_endpoint, "--pod-ip", "10.0.0.1", "--events-models", f"ns={MODEL}",
                           "--write-through", "--policy", "lru", "--events-reannounce", "1s", host_size="16KiB")
    router = routers(events_endpoint)
    pod = ["10.0.0.1:8000"]
    with KVTierClient(daemon.target) as kv:
        kv.register("ns", LAYOUT)
        prompts = [prompt(1, 2), prompt(2, 2)]
        for p in prompts:
            commit(kv, p)
        wait_for(lambda: agrees(router, kv, prompts, pod), WAIT, "llm-d to credit every page in host and disk")
        assert router.index.score(MODEL, prompts[1]) == {pod[0]: pytest.approx(2 * 0.8)}  # both blocks in host
        # The timer repeats the whole state; llm-d counts stores, so a plain repeat would keep
        # credit for a block kvtier then evicts. Let it repeat twice, then evict from host.
        time.sleep(2.5)
        router.receive(0.5)
        assert router.index.dropped["unknown_parent"] == 0
        prompts.append(prompt(3, 3))
        commit(kv, prompts[-1])  # five host pages at most: the oldest leave host, stay on disk
        wait_for(lambda: agrees(router, kv, prompts, pod), WAIT, "host evictions to take back llm-d's host credit")
        first = truth(kv, prompts[0], pod)
        assert first[0][pod[0]] == {"disk"}, "the test meant to evict prompt 1 from host"
        assert router.index.score(MODEL, prompts[0])[pod[0]] == pytest.approx(2 * 0.5)  # disk only now
    assert router.index.dropped.total() == router.index.dropped["filtered_topic"]


def test_a_node_wide_daemon_credits_every_engine_and_a_late_router_learns_it_all(daemons, events_endpoint, routers):
    daemon = daemons.start("--events", events_endpoint, "--write-through", "--events-reannounce", "0")
    early = routers(events_endpoint)
    pods = ["10.0.1.1:8000", "10.0.1.2:8000"]
    with (KVTierClient(daemon.target, engine_endpoint=pods[0], served_model=MODEL) as a,
          KVTierClient(daemon.target, engine_endpoint=pods[1], served_model=MODEL) as b):
        a.register("shared", LAYOUT)
        b.register("shared", LAYOUT)
        prompts = [prompt(4, 3), prompt(5, 2)]
        commit(a, prompts[0])
        commit(b, prompts[1])
        wait_for(lambda: agrees(early, a, prompts, pods), WAIT, "both engines credited with both engines' pages")
        late = routers(events_endpoint)  # a router that starts now learns the whole state when it subscribes
        wait_for(lambda: agrees(late, a, prompts, pods), WAIT, "a late router to learn everything")
        early.receive(0.5)  # and the early one, which heard the repeat too, still agrees
        assert all(early.credited(p) == truth(a, p, pods) for p in prompts)
    # Both engines left: their credit is taken back.
    wait_for(lambda: early.receive() or all(early.credited(p) == [{}] * len(p[::BLOCK]) for p in prompts), WAIT,
             "departed engines' credit taken back")


def test_after_a_restart_llm_d_credits_the_disk_pages_again(daemons, events_endpoint, routers):
    """Token ids are kept in the disk index: a restarted daemon tells its disk pages with
    them, so a router that matches by tokens credits them although the stop took them back."""
    args = ("--events", events_endpoint, "--pod-ip", "10.0.2.1", "--events-models", f"ns={MODEL}", "--write-through",
            "--events-reannounce", "0", "--warm-restart-window", "0")
    daemon = daemons.start(*args, name="restart")
    router = routers(events_endpoint)
    pod = ["10.0.2.1:8000"]
    prompts = [prompt(6, 3), prompt(7, 2)]
    with KVTierClient(daemon.target) as kv:
        kv.register("ns", LAYOUT)
        for p in prompts:
            commit(kv, p)
        wait_for(lambda: agrees(router, kv, prompts, pod), WAIT, "llm-d to credit the pages")
    assert daemon.stop() == 0
    router.receive(0.5)
    assert all(router.credited(p) == [{}] * (len(p) // BLOCK) for p in prompts)  # taken back at the stop
    again = daemons.start(*args, name="restart")
    with KVTierClient(again.target) as kv:
        kv.register("ns", LAYOUT)  # the layout's pool opens and reads its disk index
        wait_for(lambda: router.receive() or all(router.credited(p) == [{pod[0]: {"disk"}}] * (len(p) // BLOCK)
                                                 for p in prompts), WAIT, "the disk pages credited again")
