"""Checks of kvtier's secondary tier for vLLM's OffloadingConnector, for
tests/integrations/test_vllm_tier.py (run with .venv-vllm's python against a real daemon;
prints one JSON object):

    vllm_tier_checks.py --target unix:///path/kvtier.sock --daemon-pid PID

vLLM's own TieringOffloadingManager (vllm_tier_engine.py) with kvtier loaded by module path:
restart   engine A stores a request's blocks and is reset (vLLM drains the tier's jobs) and
          shut down; a fresh engine B looks the same keys up, gets them promoted from kvtier
          and reads the same bytes back; unknown keys miss; a model of another configuration
          under the same namespace misses too. After each shutdown: the tier's threads, the
          daemon's sessions and vLLM's shared-memory file.
rates     64 rows of 64 KiB stored by one engine and loaded by a fresh one, timed against
          one plain copy of the same bytes (figures, no expectations).
full      another client borrows every host page the daemon has: engine C's store fails as
          a job (nothing raised on the scheduler thread); once the pages are back it stores.
refused   an unknown setting and an absent daemon stop the engine's start, saying so.
gone      the daemon is stopped under engine D: lookups miss and stores fail, each
          scheduler-thread call returning at once, and D still shuts down cleanly.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import numpy as np

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

from kvtier_client import KVTierClient
from kvtier_client.tiers import Tier
from vllm.v1.kv_offload.base import make_offload_key
from vllm_tier_engine import ROW, Engine

NAMESPACE = "vllm-tier-test"


def blocks(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {make_offload_key(rng.bytes(32), 0): rng.bytes(ROW) for _ in range(n)}


def tier_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(("kvtier", "vllm_offloading_lookup")))


def after_shutdown(engine: Engine, target: str) -> dict:
    engine.shutdown()
    with KVTierClient(target) as probe:
        sessions = probe.stats().sessions
    return {"threads": tier_threads(), "daemon_sessions": sessions,
            "region_file": os.path.exists(f"/dev/shm/vllm_offload_{engine.engine_id}.mmap")}


def restart(target: str) -> dict:
    stored = blocks(6, seed=1)
    a = Engine.start(target, namespace=NAMESPACE)
    took = a.store("r1", stored)
    a.manager.reset_cache()  # drains the tier's jobs (vLLM asserts none is left)
    a_failures = dict(a.tier.gate.counts)
    a_calls = a.call_seconds
    a_end = after_shutdown(a, target)

    b = Engine.start(target, namespace=NAMESPACE)
    keys = list(stored)
    hits, loaded, answers = b.load("r2", keys)
    unknown = list(blocks(3, seed=2))
    unknown_hits, _, unknown_answers = b.load("r3", unknown)
    mixed_hits, mixed_loaded, _ = b.load("r4", keys[:3] + unknown)  # a known prefix, then new blocks
    b_end = after_shutdown(b, target)

    other = Engine.start(target, namespace=NAMESPACE, model="test/other-model")
    other_hits, _, _ = other.load("r5", keys)
    after_shutdown(other, target)
    return {
        "stored_by_cpu_tier": len(took), "a_failures": a_failures, "a_end": a_end, "b_end": b_end,
        "hits": hits, "equal": loaded == [stored[k] for k in keys[:hits]], "answers": answers,
        "unknown_hits": unknown_hits, "unknown_answers": unknown_answers,
        "mixed_hits": mixed_hits, "mixed_equal": mixed_loaded == [stored[k] for k in keys[:3]],
        "other_model_hits": other_hits, "max_call_ms": round(max(a_calls) * 1000, 3),
    }


def rates(target: str, rows: int = 64) -> dict:
    """Rows through the tier (an engine's store until vLLM's jobs settle; a fresh engine's
    lookups until the rows are in its CPU tier) against one plain copy of the same bytes."""
    stored = blocks(rows, seed=6)
    source = np.frombuffer(b"".join(stored.values()), dtype=np.uint8)
    dest = np.empty_like(source)
    np.copyto(dest, source)  # the baseline copies into memory already faulted in, as kvtier's pages are
    started = time.perf_counter()
    np.copyto(dest, source)
    memcpy = time.perf_counter() - started
    writer = Engine.start(target, namespace=NAMESPACE, rows=rows + 8)
    started = time.perf_counter()
    writer.store("rate-store", stored)
    writer.settle()
    store = time.perf_counter() - started
    writer.shutdown()
    reader = Engine.start(target, namespace=NAMESPACE, rows=rows + 8)
    started = time.perf_counter()
    hits, loaded, answers = reader.load("rate-load", list(stored))
    load = time.perf_counter() - started
    reader.shutdown()
    assert hits == rows and loaded == list(stored.values()), (hits, answers[-1:])
    mib = source.nbytes / 2**20
    return {"MiB": mib, "memcpy_MiBps": round(mib / memcpy), "store_MiBps": round(mib / store),
            "load_MiBps": round(mib / load), "store_vs_memcpy": round(memcpy / store, 4),
            "load_vs_memcpy": round(memcpy / load, 4), "load_scans": len(answers)}


def full(target: str) -> dict:
    c = Engine.start(target, namespace=NAMESPACE)
    with KVTierClient(target) as holder:
        holder.register(c.tier.namespace, c.tier.layout, algorithm="sha256")
        hold = holder.borrow(holder.pool.capacity(Tier.HOST))  # every host page: none left to lend
        c.store("r6", blocks(2, seed=3))
        c.settle()
        refused = dict(c.tier.gate.counts)
        hold.release()
    later = blocks(2, seed=4)
    c.store("r7", later)
    c.settle()
    d = Engine.start(target, namespace=NAMESPACE)  # a fresh engine finds what C stored once there was room
    hits, _, _ = d.load("r8", list(later))
    after_shutdown(d, target)
    return {"refused": refused, "after": dict(c.tier.gate.counts), "later_hits": hits,
            "end": after_shutdown(c, target)}


def refused(target: str) -> dict:
    """Engines the tier refuses to start: a misspelt setting, a daemon that is not there."""
    out = {}
    for case, tier in {"unknown_setting": {"target": target, "namspace": "x"},
                       "no_daemon": {"target": target + ".absent", "connect_timeout": 0.5}}.items():
        try:
            Engine.start(tier.pop("target"), **tier).shutdown()
            out[case] = "started"
        except (ValueError, RuntimeError) as exc:
            out[case] = f"{type(exc).__name__}: {exc}"
    out["threads"] = tier_threads()
    return out


def gone(target: str, daemon_pid: int) -> dict:
    e = Engine.start(target, namespace=NAMESPACE, connect_timeout=2.0)
    e.call_seconds.clear()
    os.kill(daemon_pid, signal.SIGTERM)
    socket = target.removeprefix("unix://")
    deadline = time.monotonic() + 20
    while os.path.exists(socket) and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.perf_counter()
    hits, _, answers = e.load("r9", list(blocks(2, seed=1)))  # A's blocks: in kvtier, but it is gone
    e.store("r10", blocks(2, seed=5))
    e.settle(timeout=30)
    took = time.perf_counter() - started
    e.shutdown()
    return {"hits": hits, "scans": len(answers), "last_scan": answers[-1], "failures": dict(e.tier.gate.counts), "threads": tier_threads(),
            "max_call_s": max(e.call_seconds), "connect_timeout_s": 2.0, "seconds": round(took, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--daemon-pid", type=int, required=True, help="stopped by the last check (gone)")
    args = parser.parse_args()
    out = {"restart": restart(args.target), "rates": rates(args.target), "full": full(args.target), "refused": refused(args.target), "gone": gone(args.target, args.daemon_pid)}
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
