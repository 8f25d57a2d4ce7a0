"""Many engines on one daemon: page operations per second with 1, 2, 4 and 8 client
processes, over the fast lane and over gRPC; and how much one engine's host hits slow down
while another engine loads pages from disk.

Throughput. Worker processes (`python -m kvtier_bench.clients`, started once, reused for
every N) each hold two clients of one `kvtier serve` subprocess, one on the lane and one
with lane=False, each its own session in one namespace. Each session commits its own 64
pages once. For a round of N processes over one transport, N workers get "go" together,
run Acquire(64 pages) + Release back to back for a warm-up and then for the measured
window, and report how many pairs they finished in the window.

    page operation = one page acquired and then released: an Acquire+Release of 64 pages
    counts 64 (not 128). pages/s = sum over workers of pairs * 64 / window.

Interference. A daemon with a disk tier and a host tier smaller than a loader's working
set: an engine (this process, on the lane) acquires and releases its 64 host-resident
pages; the loader (a worker process) cycles Acquire(WAIT_ALL) + Release over a working set
4x the host tier, so every call loads its 64 pages from disk and evicts others. The
engine's p50/p99 alone and while the loader runs, and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier_bench.harness import bench_dir, progress_bar

NAMESPACE = "bench"
DEFAULT_PROCESSES = (1, 2, 4, 8)
TARGET_PAGE_OPS = 500_000  # page operations/s with 4 client processes, 64 pages per call
TARGET_PROCESSES = 4
DEFINITION = ("page operation = one page acquired and then released (an Acquire+Release of 64 pages counts 64); "
              "pages/s = all workers' pairs x pages per call / measured window")


def _layout():
    from kvtier_client.layout import PageLayout

    return PageLayout(layers=4, kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")  # 32 KiB pages


# -- the worker process -------------------------------------------------------------------
def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _worker(target: str, index: int, keys_per_call: int, transports: Sequence[str]) -> None:
    """Serve commands on stdin, one JSON line of result each on stdout:
        run TRANSPORT WARMUP SECONDS   Acquire+Release of our pages until WARMUP + SECONDS pass
        load SECONDS_MAX              (loader) Acquire+Release cycling over our working set until "stop"
        quit
    """
    from kvtier_client import KVTierClient

    layout = _layout()
    clients: dict[str, KVTierClient] = {}
    try:
        for transport in transports:
            kv = KVTierClient(target, name=f"bench-worker-{index}-{transport}", lane=transport == "lane")
            kv.register(NAMESPACE, layout)
            if kv.transport != transport:
                raise RuntimeError(f"asked for {transport}, the client uses {kv.transport}")
            clients[transport] = kv
        keys = {}
        for transport, kv in clients.items():
            keys[transport] = kv.block_keys(list(range(keys_per_call * layout.block_tokens)),
                                            salt=f"worker-{index}-{transport}".encode())
            with kv.borrow(keys_per_call) as w:
                w.commit(keys[transport])
            kv.release(kv.acquire(keys[transport]))
        _reply({"ready": True, "pid": os.getpid(), "transports": {t: c.transport for t, c in clients.items()}})
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                return
            if words[0] == "run":
                transport, warmup, seconds = words[1], float(words[2]), float(words[3])
                kv, mine = clients[transport], keys[transport]
                clock = time.monotonic
                start = clock()
                measure_from, end = start + warmup, start + warmup + seconds
                pairs = 0
                while True:
                    now = clock()
                    if now >= end:
                        break
                    kv.release(kv.acquire(mine))
                    if now >= measure_from:
                        pairs += 1
                kv.lookup(mine[:1])  # a round trip: every release sent without reply is applied
                _reply({"pairs": pairs, "seconds": seconds, "transport": kv.transport})
            elif words[0] == "load":
                _reply(_load(clients["lane"], layout, keys_per_call, int(words[1]), index))
    finally:
        for kv in clients.values():
            kv.close()


def _load(kv, layout, n: int, pages: int, index: int) -> dict:
    """The loader: commit `pages` pages (most are demoted to disk on the way), say "loading",
    then Acquire+Release them 64 at a time, in order, round and round, until stdin says stop."""
    from kvtier_client import Wait

    working = kv.block_keys(list(range(pages * layout.block_tokens)), salt=f"loader-{index}".encode())
    batches = [working[i : i + n] for i in range(0, len(working), n)]
    for batch in batches:
        with kv.borrow(len(batch)) as w:
            w.commit(batch)
    _reply({"loading": True})
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    calls = promoted = 0
    start = time.monotonic()
    while not stop.is_set():
        for batch in batches:
            lease = kv.acquire(batch, wait=Wait.ALL)
            promoted += lease.promoted
            kv.release(lease)
            calls += 1
            if stop.is_set():
                break
    return {"calls": calls, "promoted": promoted, "seconds": time.monotonic() - start}


class Worker:
    """One worker process and its command pipe."""

    def __init__(self, target: str, index: int, keys_per_call: int, transports: Sequence[str], log: Path) -> None:
        self.index = index
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier_bench.clients", "--target", target, "--index", str(index),
             "--keys", str(keys_per_call), "--transports", ",".join(transports)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # the end

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float = 120.0) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            line = ""
        if not line:
            self.stop()
            raise RuntimeError(f"client worker {self.index} gave no answer (exit {self.proc.poll()}): "
                               f"{Path(self.log.name).read_text(errors='replace')[-800:]}")
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _start_workers(count: int, target: str, keys_per_call: int, transports: Sequence[str], root: Path) -> list[Worker]:
    workers = [Worker(target, i, keys_per_call, transports, root / f"worker-{i}.log") for i in range(count)]
    try:
        for w in workers:  # started together, answered in turn
            answer = w.receive()
            if answer.get("transports") != {t: t for t in transports}:
                raise RuntimeError(f"worker {w.index} uses {answer.get('transports')}")
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers


# -- throughput -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Round:
    transport: str
    processes: int
    pairs: int
    seconds: float
    keys_per_call: int

    @property
    def page_ops_per_s(self) -> float:
        return self.pairs * self.keys_per_call / self.seconds

    @property
    def calls_per_s(self) -> float:
        return self.pairs / self.seconds

    def as_dict(self) -> dict:
        return {"transport": self.transport, "processes": self.processes, "pairs": self.pairs, "seconds": self.seconds,
                "page_ops_per_s": self.page_ops_per_s, "acquire_release_per_s": self.calls_per_s}


def run_clients_bench(processes: Sequence[int] = DEFAULT_PROCESSES, *, seconds: float = 2.0, warmup: float = 0.3,
                      keys_per_call: int = 64, transports: Sequence[str] = ("lane", "grpc"),
                      progress: Callable[[str], None] = lambda message: None) -> dict:
    """Page operations per second for each number of client processes and each transport."""
    from kvtier_bench.services import kvtier_daemon

    processes = sorted(set(processes))
    if not processes or processes[0] <= 0 or seconds <= 0 or warmup < 0 or keys_per_call <= 0:
        raise ValueError("processes, seconds and keys per call must be positive")
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-clients-"))
    rounds: list[Round] = []
    daemon = None
    workers: list[Worker] = []
    try:
        daemon, target = kvtier_daemon(root / "daemon", host_bytes=64 << 20, name="kvtier-clients")
        progress(f"clients: starting {processes[-1]} worker processes")
        workers = _start_workers(processes[-1], target, keys_per_call, transports, root)
        with progress_bar(progress, "clients rounds", len(transports) * len(processes)) as advance:
            for transport in transports:
                for n in processes:
                    progress(f"clients: {n} process{'es' if n > 1 else ''} over {transport}, {seconds:g} s")
                    for w in workers[:n]:
                        w.send(f"run {transport} {warmup} {seconds}")
                    answers = [w.receive(60 + warmup + seconds) for w in workers[:n]]
                    if any(a["transport"] != transport for a in answers):
                        raise RuntimeError(f"a worker ran over {[a['transport'] for a in answers]}, not {transport}")
                    rounds.append(Round(transport, n, sum(a["pairs"] for a in answers), seconds, keys_per_call))
                    advance()
    finally:
        for w in workers:
            w.stop()
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    return {
        "definition": DEFINITION,
        "keys_per_call": keys_per_call,
        "seconds": seconds,
        "warmup": warmup,
        "cpus": len(os.sched_getaffinity(0)),
        "target": {"page_ops_per_s": TARGET_PAGE_OPS, "processes": TARGET_PROCESSES},
        "rounds": [r.as_dict() for r in rounds],
    }


def render_clients(result: dict) -> str:
    rounds = result["rounds"]
    transports = list(dict.fromkeys(r["transport"] for r in rounds))
    counts = list(dict.fromkeys(r["processes"] for r in rounds))
    by = {(r["transport"], r["processes"]): r for r in rounds}
    lines = [f"client processes against one daemon ({result['cpus']} CPUs): Acquire+Release of "
             f"{result['keys_per_call']} pages back to back, {result['seconds']:g} s per round",
             f"{DEFINITION}", ""]
    head = f"{'processes':>10}" + "".join(f"{t + ' pages/s':>18}{t + ' calls/s':>16}" for t in transports)
    if "lane" in transports and "grpc" in transports:
        head += f"{'lane/gRPC':>11}"
    lines.append(head)
    for n in counts:
        row = f"{n:>10}"
        for t in transports:
            r = by.get((t, n))
            row += f"{r['page_ops_per_s']:>18,.0f}{r['acquire_release_per_s']:>16,.0f}" if r else f"{'-':>18}{'-':>16}"
        if ("lane", n) in by and ("grpc", n) in by:
            row += f"{by[('lane', n)]['page_ops_per_s'] / by[('grpc', n)]['page_ops_per_s']:>11.2f}"
        lines.append(row)
    t = result["target"]
    hit = by.get(("lane", t["processes"]))
    if hit:
        met = "met" if hit["page_ops_per_s"] >= t["page_ops_per_s"] else "NOT MET"
        lines.append(f"target: >= {t['page_ops_per_s']:,} page operations/s with {t['processes']} processes over the lane: "
                     f"{hit['page_ops_per_s']:,.0f} ({met})")
    return "\n".join(lines)


# -- interference ---------------------------------------------------------------------------
def run_interference(*, iterations: int = 1000, keys_per_call: int = 64, host_pages: int = 512,
                     loader_factor: int = 4, directory: str | None = None,
                     progress: Callable[[str], None] = lambda message: None) -> dict:
    """Host-hit Acquire+Release p50/p99 of one engine alone, then while a loader process
    cycles disk loads over a working set `loader_factor` x the host tier."""
    from kvtier_client import KVTierClient

    from kvtier_bench.rpc import Latency
    from kvtier_bench.services import kvtier_daemon

    layout = _layout()
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-interference-", dir=bench_dir(directory)))
    daemon = kv = None
    workers: list[Worker] = []
    try:
        daemon, target = kvtier_daemon(root / "daemon", host_bytes=host_pages * layout.slot_bytes, name="kvtier-interf",
                                       extra=("--disk-size", str(host_pages * loader_factor * 2 * layout.slot_bytes)))
        kv = KVTierClient(target, name="bench-engine")
        kv.register(NAMESPACE, layout)
        keys = kv.block_keys(list(range(keys_per_call * layout.block_tokens)), salt=b"engine")
        with kv.borrow(keys_per_call) as w:
            w.commit(keys)
        workers = _start_workers(1, target, keys_per_call, ("lane",), root)
        loader = workers[0]
        loader_pages = host_pages * loader_factor
        progress(f"interference: loader commits {loader_pages} pages ({loader_factor}x the host tier)")
        loader.send(f"load {loader_pages}")
        loader.receive(300)  # "loading": its pages are committed, from now on it loads from disk
        loader_running = True
        # Our pages may have been evicted by the loader's commits: bring them back first.
        kv.release(kv.acquire(keys))

        def measure() -> tuple[list[float], int]:
            samples, promoted = [], 0
            for _ in range(iterations):
                start = time.perf_counter()
                lease = kv.acquire(keys)
                kv.release(lease)
                samples.append(time.perf_counter() - start)
                promoted += lease.promoted
            return samples, promoted

        for _ in range(50):
            kv.release(kv.acquire(keys))
        progress(f"interference: {iterations} Acquire+Release while the loader loads from disk")
        busy, busy_promoted = measure()
        loader.send("stop")
        loaded = loader.receive(120)
        loader_running = False
        progress(f"interference: {iterations} Acquire+Release alone")
        alone, alone_promoted = measure()
    finally:
        if kv is not None:
            kv.close()
        for w in workers:
            w.stop()
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    a, b = Latency.of(alone), Latency.of(busy)
    return {
        "keys_per_call": keys_per_call,
        "page_bytes": layout.page_bytes,
        "host_pages": host_pages,
        "loader_pages": host_pages * loader_factor,
        "alone": vars(a) | {"promoted_pages": alone_promoted},
        "with_loader": vars(b) | {"promoted_pages": busy_promoted},
        "p50_ratio": b.p50_us / a.p50_us,
        "p99_ratio": b.p99_us / a.p99_us,
        "loader": {"acquire_release_calls": loaded["calls"], "pages_loaded_from_disk": loaded["promoted"],
                   "seconds": loaded["seconds"],
                   "pages_loaded_per_s": loaded["promoted"] / max(loaded["seconds"], 1e-9)},
        "loader_running_at_end": loader_running,
    }


def render_interference(result: dict) -> str:
    a, b, ld = result["alone"], result["with_loader"], result["loader"]
    return "\n".join([
        f"interference: one engine's host-hit Acquire+Release of {result['keys_per_call']} pages (lane), alone and "
        f"while another process loads from disk",
        f"  (host tier {result['host_pages']} pages of {result['page_bytes'] // 1024} KiB; the loader cycles "
        f"{result['loader_pages']} pages, {ld['pages_loaded_per_s']:,.0f} pages/s loaded from disk while measured)",
        f"{'':>14}{'p50 us':>10}{'p99 us':>10}{'our pages reloaded':>20}",
        f"{'alone':>14}{a['p50_us']:>10.0f}{a['p99_us']:>10.0f}{a['promoted_pages']:>20}",
        f"{'with loader':>14}{b['p50_us']:>10.0f}{b['p99_us']:>10.0f}{b['promoted_pages']:>20}",
        f"{'ratio':>14}{result['p50_ratio']:>10.2f}{result['p99_ratio']:>10.2f}",
    ])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a client worker of kvtier_bench.clients (not for people)")
    parser.add_argument("--target", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--transports", default="lane,grpc")
    args = parser.parse_args()
    _worker(args.target, args.index, args.keys, args.transports.split(","))
