"""Put and get through one daemon from P client processes, against the same P processes
copying the same bytes into a cold private buffer (`kvtier bench tiers --daemon`).

For each page size (default 2 MiB pages, 32 per call, and 64 KiB pages, 64 per call) and
each number of processes P (default 1, 2, 4), over a working set split evenly between them:

    op          kvtier, through a `kvtier serve` subprocess     baseline, the same P processes
    put         borrow(n), lease.write each engine page into     np.copyto the same engine pages
                its page (the worker's mapping of the daemon's   into a private numpy buffer of
                shared memory; a copy that hashes as it goes),   their share, page by page
                commit under new keys with the checksums
    get         acquire(n keys), np.copyto each page view into   np.copyto from that buffer into
                the engine's sink, release                       the same sink
    first fill  1 process puts the whole working set into a      np.copyto into a freshly
                FRESH daemon: the first touch of its shared      allocated buffer never touched
                memory (page faults, populating) counts           (its page faults count)

Why the baseline is cold: the working set (default 1 GiB of 2 MiB pages, 256 MiB of 64 KiB
pages) is meant to be far larger than the last-level cache, so a put writes memory, not
cache. The baseline's buffer is as large as the working set and written once before it is
timed (no first-touch faults, except in first fill), so it is not in cache either: a small,
cache-hot buffer would make the baseline a cache-to-cache copy no store could reach. A note
says when the working set is under 4x the LLC. numpy asks for transparent huge pages for
its buffers (kept for the baseline: an engine's buffer gets them too); the daemon's shared
memory has them only if shmem_enabled allows; the result says which.

Timing: the workers (`python -m kvtier_bench.procs`, over pipes as in clients.py) start once
per daemon and are reused. For each phase every worker prepares (keys, buffers) and says
ready, then all get "go"; the time runs from go until the last worker is done (CLOCK_MONOTONIC,
shared by the processes). Throughput = all bytes / time; ratio = kvtier / baseline (1.0: the
daemon adds nothing); medians over repetitions, odd ones timing the baseline first. Gets are
verified untimed, between phases: each sink against its engine pages (harness.verify), and
the first and last 8 bytes of every page put, acquired again.

Steady state: each repetition starts a fresh daemon whose host tier holds exactly the working
set, no disk. First fill puts generation 0 (1 process); then every worker reads each arena
slot once through its own mapping (its page tables filled, as in a running engine). Each
round of P processes puts a new generation: every borrow evicts pages of the previous one
(eviction is part of a steady put) and the get reads the generation just put, all in host
memory. The daemon runs --policy lru: the default (frecency) evicts only the leaves of
prefix chains, and with each worker's pages one chain it now and then refused a borrow
("0 evictable") while the previous generation was still cached.
"""
from __future__ import annotations

import argparse
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvtier_bench.clients import Worker as _PipeWorker
from kvtier_bench.clients import _reply
from kvtier_bench.harness import (ENGINE_RING_BYTES, KiB, MiB, batches, bench_dir, format_size, layout_for,
                                  machine_info, median_pair, progress_bar, verify)

NAMESPACE = "bench"
POLICY = "lru"
DEFAULT_PAGE_SIZES = (2 * MiB, 64 * KiB)
DEFAULT_PROCESSES = (1, 2, 4)
DEFAULT_REPS, QUICK_REPS = 3, 1
WORKING_SET = {2 * MiB: 1024 * MiB, 64 * KiB: 256 * MiB}  # other sizes: 256 MiB
QUICK_WORKING_SET = {2 * MiB: 256 * MiB}  # other sizes: 64 MiB
OPS = ("get", "put", "first fill")
#: The issue's targets: (op, page bytes, processes, minimum ratio).
TARGETS = (("put", 2 * MiB, 1, 0.8), ("put", 2 * MiB, 4, 0.8), ("put", 64 * KiB, 1, 0.5), ("put", 64 * KiB, 4, 0.5),
           ("first fill", 2 * MiB, 1, 0.5), ("first fill", 64 * KiB, 1, 0.5),
           ("get", 2 * MiB, 4, 0.9), ("get", 64 * KiB, 4, 0.7))
DEFINITION = ("ratio = kvtier throughput / the same processes' np.copyto of the same bytes into (put) or out of "
              "(get) a cold private buffer; time = from go until the last process is done")


def pages_per_call(page_bytes: int) -> int:
    return 32 if page_bytes >= MiB else 64


def default_pages(page_bytes: int, quick: bool = False) -> int:
    table, other = (QUICK_WORKING_SET, 64 * MiB) if quick else (WORKING_SET, 256 * MiB)
    return max(1, table.get(page_bytes, other) // page_bytes)


def shares(pages: int, processes: int) -> list[int]:
    return [pages // processes + (i < pages % processes) for i in range(processes)]


def _key(gen: int, index: int, i: int) -> bytes:
    return b"procs" + gen.to_bytes(4, "little") + index.to_bytes(2, "little") + i.to_bytes(8, "little")


# -- the worker process -------------------------------------------------------------------
def _serve(target: str, index: int, page_bytes: int, per_call: int, ring: int) -> None:
    """Commands on stdin, "OP GEN PAGES": put / get / base_put / base_get / base_fill answer
    {"ready"}, wait for "go", run, answer {"end": monotonic}; touch and check answer at once."""
    from kvtier_client import KVTierClient

    from kvtier_bench.peers.kvtier import raw

    engine = np.frombuffer(np.random.default_rng(index).bytes(ring * page_bytes), np.uint8).reshape(ring, page_bytes)
    sink = np.empty_like(engine)
    sink.fill(1)
    buf = np.empty((0, page_bytes), np.uint8)
    client = KVTierClient(target, name=f"bench-procs-{index}")
    try:
        client.register(NAMESPACE, layout_for(page_bytes)[1])
        _reply({"ready": True, "pid": os.getpid(), "transport": client.transport})
        while True:
            words = sys.stdin.readline().split()
            if not words or words[0] == "quit":
                return
            op, gen, pages = words[0], int(words[1]), int(words[2])
            keys = [_key(gen, index, i) for i in range(pages)]
            calls = batches(pages, per_call)

            def put() -> None:
                parent = None
                for start, n in calls:
                    lease = client.borrow(n)
                    for j in range(n):  # a copy that hashes as it goes (what engines are told to use)
                        lease.write(j, engine[(start + j) % ring])
                    client.commit(lease, keys[start:start + n], parent=parent)
                    parent = keys[start + n - 1]

            def get() -> None:
                for start, n in calls:
                    lease = client.acquire(keys[start:start + n])
                    for j, page in enumerate(lease.pages):
                        np.copyto(sink[(start + j) % ring], raw(page))
                    client.release(lease)

            def base_put() -> None:
                for start, n in calls:
                    for i in range(start, start + n):
                        np.copyto(buf[i], engine[i % ring])

            def base_get() -> None:
                for start, n in calls:
                    for i in range(start, start + n):
                        np.copyto(sink[i % ring], buf[i])

            if op == "touch":  # map every arena slot in this process (read one byte per 4 KiB)
                arena = client.host_arena
                for slot in range(arena.slots):
                    arena.raw(slot, writable=False)[::4096].max()
                _reply({"touched": arena.slots})
                continue
            if op == "check":  # untimed, after a get: the sink, then every page's ends
                verify(engine, sink, pages, f"worker {index}: get")
                for start, n in calls:
                    lease = client.acquire(keys[start:start + n])
                    for j, page in enumerate(lease.pages):
                        got, want = raw(page), engine[(start + j) % ring]
                        if not (np.array_equal(got[:8], want[:8]) and np.array_equal(got[-8:], want[-8:])):
                            raise RuntimeError(f"worker {index}: page {start + j} came back with other bytes")
                    client.release(lease)
                _reply({"checked": pages})
                continue
            if op == "base_fill" or (op == "base_put" and len(buf) != pages):
                buf = np.empty((0, page_bytes), np.uint8)  # free the old one first
                buf = np.empty((pages, page_bytes), np.uint8)  # never touched: first-touch faults
                if op == "base_put":
                    buf.fill(0)  # touched once: no faults when timed, and not in cache either
            work = {"put": put, "get": get, "base_put": base_put, "base_get": base_get, "base_fill": base_put}[op]
            _reply({"ready": True})
            if sys.stdin.readline().strip() != "go":
                return
            work()
            _reply({"end": time.monotonic()})
            if op == "base_fill":
                buf = np.empty((0, page_bytes), np.uint8)
    finally:
        client.close()


class _Worker(_PipeWorker):
    """One worker process and its command pipe (clients.py's, with this module's worker)."""

    def __init__(self, target: str, index: int, page_bytes: int, per_call: int, ring: int, log: Path) -> None:
        self.index = index
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier_bench.procs", "--target", target, "--index", str(index),
             "--page-bytes", str(page_bytes), "--per-call", str(per_call), "--ring", str(ring)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()


# -- the coordinator --------------------------------------------------------------------------
def _phase(workers: Sequence[_Worker], op: str, gen: int, pages: Sequence[int]) -> float:
    """Seconds from "go" until the last of `workers` has done `op` on its `pages`."""
    for w, n in zip(workers, pages):
        w.send(f"{op} {gen} {n}")
    for w in workers:
        w.receive(300)
    start = time.monotonic()
    for w in workers:
        w.send("go")
    return max(w.receive(600)["end"] for w in workers) - start


def _call(workers: Sequence[_Worker], op: str, gen: int, pages: Sequence[int]) -> list[dict]:
    for w, n in zip(workers, pages):
        w.send(f"{op} {gen} {n}")
    return [w.receive(600) for w in workers]


def _repetition(page_bytes: int, pages: int, processes: Sequence[int], rep: int, root: Path,
                progress: Callable[[str], None]) -> tuple[dict[tuple[str, int], tuple[float, float]], int]:
    """One fresh daemon: {(op, P): (kvtier seconds, baseline seconds)} and the pages checked."""
    from kvtier_bench.services import kvtier_daemon

    layout = layout_for(page_bytes)[1]
    n_workers = max(processes)
    ring = max(1, min(pages, ENGINE_RING_BYTES // (n_workers * page_bytes)))
    seconds: dict[tuple[str, int], tuple[float, float]] = {}
    checked: list[int] = []
    daemon, target = kvtier_daemon(root / f"daemon-{page_bytes}-{rep}", host_bytes=pages * layout.slot_bytes,
                                   name="kvtier-procs", extra=("--policy", POLICY))
    workers: list[_Worker] = []
    try:
        for i in range(n_workers):
            workers.append(_Worker(target, i, page_bytes, pages_per_call(page_bytes), ring, root / f"worker-{i}.log"))
        for w in workers:
            if w.receive(120).get("transport") != "lane":
                raise RuntimeError(f"client worker {w.index} does not use the fast lane")

        def pair(p: int, tier_op: str, base_op: str, gen: int, check: bool = False) -> tuple[float, float]:
            """(kvtier, baseline) seconds with the first p workers; odd repetitions time the baseline first."""
            group, share = workers[:p], shares(pages, p)
            b = _phase(group, base_op, gen, share) if rep % 2 else None
            t = _phase(group, tier_op, gen, share)
            if check:
                checked.extend(a["checked"] for a in _call(group, "check", gen, share))
            return t, _phase(group, base_op, gen, share) if b is None else b

        progress(f"procs {format_size(page_bytes)}: first fill of a fresh daemon, repetition {rep + 1}")
        seconds[("first fill", 1)] = pair(1, "put", "base_fill", 0)
        _call(workers, "touch", 0, [0] * n_workers)
        for gen, p in enumerate(processes, 1):
            progress(f"procs {format_size(page_bytes)}: put and get with {p} process{'es' if p > 1 else ''}")
            seconds[("put", p)] = pair(p, "put", "base_put", gen)
            seconds[("get", p)] = pair(p, "get", "base_get", gen, check=True)
    finally:
        for w in workers:
            w.stop()
        daemon.stop()
    return seconds, sum(checked)


def _sysfs(path: str, pattern: str) -> str | None:
    try:
        found = re.search(pattern, Path(path).read_text())
    except OSError:
        return None
    return found and found.group(1)


def _llc_bytes() -> int | None:
    kib = _sysfs("/sys/devices/system/cpu/cpu0/cache/index3/size", r"^(\d+)K")
    return int(kib) * KiB if kib else None


def _thp() -> dict:
    return {name: _sysfs(f"/sys/kernel/mm/transparent_hugepage/{path}", r"\[(\w+)\]")
            for name, path in (("anon", "enabled"), ("shmem", "shmem_enabled"))}


def run_procs(page_sizes: Sequence[int] = DEFAULT_PAGE_SIZES, *, processes: Sequence[int] = DEFAULT_PROCESSES,
              pages: int | None = None, quick: bool = False, reps: int | None = None, directory: str | None = None,
              progress: Callable[[str], None] = lambda message: None) -> dict:
    """The put/get/first-fill ratios for each page size and number of processes."""
    processes = sorted(set(processes))
    reps = reps if reps is not None else (QUICK_REPS if quick else DEFAULT_REPS)
    if not processes or processes[0] <= 0 or reps <= 0 or (pages is not None and pages < processes[-1]):
        raise ValueError("processes and repetitions must be positive, and pages at least the processes")
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-procs-", dir=bench_dir(directory)))
    llc, sizes, rows, checked = _llc_bytes(), [], [], 0
    try:
        for size in dict.fromkeys(page_sizes):
            n = pages or default_pages(size, quick)
            sizes.append({"page_bytes": size, "page_size": format_size(size), "pages_per_call": pages_per_call(size),
                          "pages": n, "working_set_bytes": n * size, "layout": layout_for(size)[0]})
            samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
            with progress_bar(progress, f"procs {format_size(size)}", reps) as advance:
                for rep in range(reps):
                    got, verified = _repetition(size, n, processes, rep, root, progress)
                    checked += verified
                    for k, pair in got.items():
                        samples.setdefault(k, []).append(pair)
                    advance()
            for (op, p), pairs in samples.items():
                r = median_pair(n, size, op, pairs)
                rows.append({"page_bytes": size, "op": op, "processes": p, "tier": r.tier.as_dict(),
                             "baseline": r.baseline.as_dict(), "ratio": r.ratio,
                             "samples": {"tier": [t for t, _ in pairs], "baseline": [b for _, b in pairs]}})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    by = {(r["op"], r["page_bytes"], r["processes"]): r["ratio"] for r in rows}
    targets = [{"op": op, "page_bytes": size, "processes": p, "target": t, "measured": by.get((op, size, p)),
                "met": None if (op, size, p) not in by else by[(op, size, p)] >= t} for op, size, p, t in TARGETS]
    notes = [f"the working set of {s['page_size']} pages ({format_size(s['working_set_bytes'])}) is less than 4x the "
             f"last-level cache ({format_size(llc)}): both sides may be partly in cache (--pages makes it larger)"
             for s in sizes if llc and s["working_set_bytes"] < 4 * llc]
    cpus = len(os.sched_getaffinity(0))
    if processes[-1] >= cpus:
        notes.append(f"{processes[-1]} client processes and the daemon share {cpus} CPUs")
    return {"definition": DEFINITION, "machine": machine_info(), "llc_bytes": llc, "transparent_hugepages": _thp(),
            "policy": POLICY, "reps": reps, "processes": processes, "sizes": sizes, "rows": rows,
            "verified_pages": checked, "targets": targets, "notes": notes}


def render_procs(result: dict) -> str:
    by = {(r["op"], r["page_bytes"], r["processes"]): r for r in result["rows"]}
    ps = result["processes"]
    head = ["page size, pages/call", *(f"{op} {' / '.join(map(str, ps))}" for op in OPS[:2]), "first fill (1 proc)"]
    ratios, speeds = [head], [("page size", "op", "processes", "kvtier GB/s", "baseline GB/s", "ratio")]
    for s in result["sizes"]:
        size = s["page_bytes"]
        cells = [f"{s['page_size']}, {s['pages_per_call']}"]
        for op, counts in (("get", ps), ("put", ps), ("first fill", [1])):
            cells.append(" / ".join(f"{by[(op, size, p)]['ratio']:.2f}x" for p in counts))
            for p in counts:
                r = by[(op, size, p)]
                speeds.append((s["page_size"], op, str(p), f"{r['tier']['gb_per_s']:.2f}",
                               f"{r['baseline']['gb_per_s']:.2f}", f"{r['ratio']:.2f}x"))
        ratios.append(cells)

    def table(rows: list, sep: str, left: int) -> list[str]:
        """Columns padded to their widest cell, the first `left` of them flush left."""
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        return [sep.join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                for row in rows]

    m = result["machine"]
    lines = [f"put and get through the daemon, P client processes ({m['nproc']} CPUs), ratio to P processes copying "
             "the same bytes into a cold private buffer", *table(ratios, " | ", len(head)), "",
             "GB/s of each side (first fill: 1 process into a fresh daemon / a never-touched buffer)",
             *table(speeds, "  ", 2), "",
             "working set " + ", ".join(f"{format_size(s['working_set_bytes'])} of {s['page_size']} pages"
                                        for s in result["sizes"])
             + f"; median of {result['reps']}; last-level cache "
             + (format_size(result["llc_bytes"]) if result["llc_bytes"] else "unknown")
             + f"; daemon --policy {result['policy']}; {result['verified_pages']:,} pages got and verified",
             f"transparent huge pages: numpy buffers {result['transparent_hugepages']['anon']}, "
             f"the daemon's shared memory {result['transparent_hugepages']['shmem']}",
             "targets (the issue's):"]
    for t in (t for t in result["targets"] if t["page_bytes"] in {s["page_bytes"] for s in result["sizes"]}):
        measured = "not measured" if t["met"] is None else f"{t['measured']:.2f}x ({'met' if t['met'] else 'NOT MET'})"
        lines.append(f"  {t['op']} >= {t['target']}x at {format_size(t['page_bytes'])} with {t['processes']} "
                     f"process{'es' if t['processes'] > 1 else ''}: {measured}")
    lines.extend(f"note: {note}" for note in result["notes"])
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a client worker of kvtier_bench.procs (not for people)")
    parser.add_argument("--target", required=True)
    for name in ("--index", "--page-bytes", "--per-call", "--ring"):
        parser.add_argument(name, type=int, required=True)
    args = parser.parse_args()
    _serve(args.target, args.index, args.page_bytes, args.per_call, args.ring)
