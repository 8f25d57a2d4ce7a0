"""The `continue-ttl` hint rule's mechanics on the head of the real Mooncake trace (read in
place): hints come only from requests already served, their TTLs end on the trace's clock,
and the same requests are counted with and without it. Whether the rule wins is a figure
(kvtier replay --hint-rule), not a test."""
from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.policy.classes import Rank
from kvtier.replay.hints import (
    DEFAULT_TTL_FACTOR,
    ContinueTTL,
    HintRule,
    replay_with_hints,
)
from kvtier.replay.mooncake import halfway, read_timed_trace, replay

KVTIER = str(Path(sys.executable).parent / "kvtier")
HEAD = 1500  # about 8 minutes of trace: several TTLs of a few median gaps
HOST_PAGES = 400  # small enough that eviction chooses between hinted and normal blocks


@pytest.fixture(scope="module")
def timed(mooncake_trace) -> list[tuple[int, list[int]]]:
    return list(itertools.islice(read_timed_trace(str(mooncake_trace)), HEAD))


def run(timed, hook=None) -> ContinueTTL:
    """Replay `timed` with the rule; `hook(index, keys, store, rule)` runs after the rule."""
    rule = ContinueTTL([t for t, _ in timed])

    def after(index, keys, store):
        rule(index, keys, store)
        if hook is not None:
            hook(index, keys, store, rule)

    replay([ids for _, ids in timed], host_pages=HOST_PAGES, policy="frecency", after_request=after)
    return rule


def test_hints_come_only_from_requests_already_served(timed):
    whole = run(timed)
    head = run(timed[:900])
    assert whole.retains, "the head of the trace has conversations: the rule must hint some"
    # What the rule did up to request 900 does not depend on the requests after it.
    assert [r for r in whole.retains if r.request < 900] == head.retains
    gaps = []
    for r in whole.retains:
        earlier_ids, ids = timed[r.continues][1], timed[r.request][1]
        assert r.continues < r.request
        assert ids[:len(earlier_ids) - 1] == earlier_ids[:-1] and len(ids) >= max(2, len(earlier_ids) - 1)
        assert r.at == timed[r.request][0] / 1000
        gaps.append(r.at - timed[r.continues][0] / 1000)
        assert r.ttl == pytest.approx(DEFAULT_TTL_FACTOR * statistics.median(gaps))  # the gaps so far, no later one


def test_retained_blocks_rank_high_until_their_ttl_ends(timed):
    ran_out = set()

    def check(index, keys, store, rule):
        table = store.control.hints
        now = table.clock()  # the next request's arrival: the time it will be served at
        assert now == timed[min(index + 1, len(timed) - 1)][0] / 1000
        if rule.retains and rule.retains[-1].request == index:
            at = timed[index][0] / 1000
            cached = [("trace", k) for k in keys if ("trace", k) in store.blocks]
            assert len(cached) == rule.retains[-1].applied
            assert all(table.hints[ref].expires == at + rule.retains[-1].ttl for ref in cached)
        for ref, hint in table.hints.items():
            assert hint.rank is Rank.HIGH and hint.expires > 0
            if hint.expires <= now:
                assert table.rank(ref) is Rank.NORMAL
                ran_out.add(ref)
            else:
                assert table.rank(ref) is Rank.HIGH
        if index == len(timed) - 1 and table.hints:  # past the last TTL, nothing ranks high and the table empties
            rule.now = max(h.expires for h in table.hints.values())
            assert all(table.rank(ref) is Rank.NORMAL for ref in table.hints)
            table.expire()
            assert not table.hints

    rule = run(timed, check)
    assert rule.retains and ran_out, "some TTL should end within the head of the trace"


def test_the_same_requests_are_counted_with_and_without_the_rule(timed):
    start = halfway([t for t, _ in timed])
    for measure_from in (0, start):
        plain, none = replay_with_hints(timed, rule=HintRule.NONE, host_pages=HOST_PAGES, policy="frecency",
                                        measure_from=measure_from)
        hinted, summary = replay_with_hints(timed, host_pages=HOST_PAGES, policy="frecency", measure_from=measure_from)
        assert none is None and summary is not None and summary.retains
        assert (hinted.requests, hinted.blocks) == (plain.requests, plain.blocks) == (
            HEAD - measure_from, sum(len(ids) for _, ids in timed[measure_from:]))
        assert hinted.hit_blocks == hinted.host_hit_blocks + hinted.disk_hit_blocks


def test_cli_reports_the_rule(timed, tmp_path):
    head = tmp_path / "head.jsonl"
    head.write_text("".join(json.dumps({"timestamp": t, "hash_ids": ids}) + "\n" for t, ids in timed[:600]))
    out = subprocess.run([KVTIER, "replay", str(head), "--host-pages", str(HOST_PAGES), "--policy", "frecency",
                          "--hint-rule", "continue-ttl", "--hint-ttl-factor", "3", "--json"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["requests"] == 600
    assert data["hints"]["rule"] == "continue-ttl" and data["hints"]["ttl_factor"] == 3
    assert 0 < data["hints"]["retains"] <= data["hints"]["continuations"]
    refused = subprocess.run([KVTIER, "replay", str(head), "--hint-ttl-factor", "0"], capture_output=True, text=True, check=False)
    assert refused.returncode == 2 and "--hint-ttl-factor" in refused.stderr
