"""Synthetic traces of known shapes, in the Mooncake form, for `kvtier bench trace --shape`.

One real trace says how the policies do on one workload; these say on which kind of
workload a policy wins or loses. Each generator is deterministic for a seed and returns
(timestamp in ms, hash_ids) pairs in time order, prefix-chained as in Mooncake traces: one
id per 512-token block, requests that share a prefix share its leading ids, and an id is
fresh for every distinct block content, so an id always follows the same predecessor.

At `scale=1` a shape has 100k to 150k blocks (a few seconds per replay through the store),
sized so that the hit rate still changes between 1M and 30M tokens of cache (1,953 to
58,594 pages); a smaller `scale` gives the same shape with fewer requests (tests).
"""
from __future__ import annotations

import bisect
import itertools
import json
import math
import os
import random
from collections.abc import Callable

from kvtier_bench.internals import TRACE_BLOCK_TOKENS

TimedRequest = tuple[int, list[int]]
#: The one-off documents of `scan` take their ids from here up, so they can be told apart.
ONE_OFF_BASE = 1 << 40
#: The span of a trace at scale 1: one hour, as the Mooncake conversation trace.
SPAN_MS = 3_600_000


class _Ids:
    """Fresh block ids, one per distinct block content."""

    def __init__(self, start: int = 1) -> None:
        self._next = itertools.count(start)

    def fresh(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def _poisson_times(rng: random.Random, n: int, span_ms: int) -> list[int]:
    """`n` arrival times of a Poisson process over about `span_ms`, in order."""
    mean_gap = span_ms / n
    t, times = 0.0, []
    for _ in range(n):
        t += rng.expovariate(1 / mean_gap)
        times.append(int(t))
    return times


def _zipf_picker(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    """Draws an index in [0, n) with Zipfian popularity: P(rank r) ~ 1 / r**s."""
    cumulative = list(itertools.accumulate(1 / (r ** s) for r in range(1, n + 1)))
    total = cumulative[-1]
    return lambda: min(n - 1, bisect.bisect_left(cumulative, rng.random() * total))


def _prefixes(rng: random.Random, ids: _Ids, n: int, lengths: tuple[int, int]) -> list[list[int]]:
    return [ids.fresh(rng.randint(*lengths)) for _ in range(n)]


def _zipf_requests(rng: random.Random, ids: _Ids, scale: float, span_ms: int) -> list[TimedRequest]:
    prefixes = _prefixes(rng, ids, _scaled(20_000, scale), (2, 10))
    pick = _zipf_picker(rng, len(prefixes), 1.0)
    times = _poisson_times(rng, _scaled(15_000, scale), span_ms)
    return [(t, prefixes[pick()] + ids.fresh(rng.randint(1, 4))) for t in times]


def zipf(seed: int = 0, scale: float = 1.0) -> list[TimedRequest]:
    """Shared system prompts and documents (2 to 10 blocks each) picked with Zipfian
    popularity (s = 1.0) out of 20,000, each followed by a unique user message of 1 to 4
    blocks: a service where a few prompts are everywhere and a long tail comes back now
    and then. Frequency pays here; a one-time user block is never reused."""
    return _zipf_requests(random.Random(seed), _Ids(), scale, SPAN_MS)


def _session_requests(rng: random.Random, ids: _Ids, scale: float, span_ms: int) -> list[TimedRequest]:
    prompts = _prefixes(rng, ids, 8, (1, 4))
    turns: list[tuple[int, int, int, list[int]]] = []  # (time, session, turn, ids)
    for session in range(_scaled(420, scale)):
        t = rng.uniform(0, 0.1 * span_ms)
        context = rng.choice(prompts) + ids.fresh(rng.randint(1, 3))
        n_turns = 5 + int(35 * rng.random() ** 3)  # 5 to 40, most short
        think_ms = 0.9 * span_ms / n_turns  # every session lasts about the trace's span
        for turn in range(n_turns):
            if turn:
                t += rng.lognormvariate(math.log(think_ms), 1.0)
                context = context[:-1] + ids.fresh(rng.randint(2, 4))
            turns.append((int(t), session, turn, context))
    turns.sort(key=lambda x: x[:3])
    return [(t, ids_) for t, _, _, ids_ in turns]


def sessions(seed: int = 0, scale: float = 1.0) -> list[TimedRequest]:
    """Many concurrent multi-turn chats of 5 to 40 turns (most short). A turn resends the
    previous turn's blocks but its last (partial) one, then the previous answer and the new
    message as 2 to 4 new blocks, so a request's last block is never reused, as in real chat
    traces. The chats start within the first tenth of the span and spread their turns over
    it with log-normal think times, so the blocks other chats touch between two turns of
    one range from a few hundred to all the live contexts: recency pays here. A block is
    resent by every later turn, so distinct blocks are about an eighth of all blocks and
    the hit rate stops growing at about 16k pages."""
    return _session_requests(random.Random(seed), _Ids(), scale, SPAN_MS)


def scan(seed: int = 0, scale: float = 1.0) -> list[TimedRequest]:
    """A hot set of shared prefixes (4 to 16 blocks, Zipfian s = 0.8, each with a 1 to 3
    block unique suffix) that keeps being reused, interleaved with bursts of one-off
    documents (16 to 64 blocks, never read again: a batch job summarising a stack of
    files), about 40% of all blocks. A policy that lets a scan flush the hot set loses; the
    documents' ids start at ONE_OFF_BASE."""
    rng = random.Random(seed)
    ids, one_off = _Ids(), _Ids(ONE_OFF_BASE)
    hot = _prefixes(rng, ids, _scaled(3_000, scale), (4, 16))
    pick = _zipf_picker(rng, len(hot), 0.8)
    requests: list[list[int]] = []
    while len(requests) < _scaled(7_000, scale):
        if rng.random() < 0.04:  # a burst of documents
            requests += [one_off.fresh(rng.randint(16, 64)) for _ in range(rng.randint(1, 8))]
        else:
            requests.append(hot[pick()] + ids.fresh(rng.randint(1, 3)))
    times = _poisson_times(rng, len(requests), SPAN_MS)
    return list(zip(times, requests))


def shift(seed: int = 0, scale: float = 1.0) -> list[TimedRequest]:
    """The mix changes halfway through: the first half of the time is `zipf` traffic, the
    second half `sessions` traffic on fresh ids (a deployment whose users move from a
    document service to chat). Both halves span the same time, so the trace's time
    midpoint is where the second begins; a policy tuned to the first half must adapt."""
    rng = random.Random(seed)
    ids = _Ids()
    second = _session_requests(rng, ids, scale / 2, SPAN_MS // 2)
    first = _zipf_requests(rng, ids, scale / 2, SPAN_MS // 2)
    # Both halves on [0, span) and [span, 2 * span): the time midpoint is where the second begins.
    span = max(second[-1][0] - second[0][0], 2)
    t0, t1 = first[0][0], first[-1][0]
    return ([((t - t0) * (span - 1) // max(t1 - t0, 1), ids_) for t, ids_ in first]
            + [(t - second[0][0] + span, ids_) for t, ids_ in second])


SHAPES: dict[str, Callable[..., list[TimedRequest]]] = {"zipf": zipf, "sessions": sessions, "scan": scan, "shift": shift}


def generate(name: str, seed: int = 0, scale: float = 1.0) -> list[TimedRequest]:
    """The shape `name`'s requests (ValueError for an unknown name)."""
    try:
        make = SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown trace shape {name!r}; use one of {', '.join(SHAPES)}") from None
    return make(seed, scale)


def describe(name: str) -> str:
    """The first sentence of a shape's docstring: what traffic it stands for."""
    doc = " ".join((SHAPES[name].__doc__ or "").split())
    return doc.split(". ")[0].rstrip(".") + "."


def write_jsonl(requests: list[TimedRequest], path: str | os.PathLike) -> None:
    """A Mooncake-format trace file: one JSON object per request. Lengths are not modelled:
    `input_length` counts whole blocks and `output_length` is 0."""
    with open(path, "w") as f:
        for t, ids in requests:
            f.write(json.dumps({"timestamp": t, "input_length": len(ids) * TRACE_BLOCK_TOKENS, "output_length": 0,
                                "hash_ids": ids}) + "\n")
