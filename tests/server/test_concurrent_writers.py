"""Several client processes write, look up and read back at once against one real daemon
whose host tier is small enough that every batch evicts pages to disk, and whose disk tier
evicts in turn: no page is ever served under the wrong key or namespace, and afterwards
everything the daemon shows from outside adds up.

Each of PROCS processes (`kvtier_client.KVTierClient`, one client per namespace, over the
fast lane and mapped arenas as an engine would) runs for LOAD_S seconds, round after round:

- borrows a batch, fills each page with bytes derived from its namespace and key, and
  commits it in namespace A (every third round the same keys in namespace B too, with B's
  bytes: a page served across namespaces would show);
- looks the batch up;
- acquires (acquire-prefix) a recent batch, its own or another process's, in either
  namespace: many are on disk by then, so they are loaded; every page leased must hold
  exactly the bytes of its key;
- now and then prefetches an older batch, and borrows pages it releases unused.

Meanwhile, in every Stats snapshot: per tier free + writing + cached == capacity and no
state is negative (docs/invariants.md, rule 8), and the namespaces' pages add up to the
tier's (rule 9). Then, with every client closed: the same, no session or lease is left,
nothing is pinned, loading or being written; no page failed a check or an I/O;
the traffic really went through disk (pages written there, evicted from there, loaded from
there); every batch still cached reads back right; and the daemon still serves. The daemon
has no way to run kvtier.core.invariants.check_invariants on itself, so these are the
checks there are from outside.

Why it cannot be flaky: nothing is timed but the load's length; each process's checks are
exact (bytes equal), the traffic thresholds are far below what a few seconds make (a batch
evicts host pages every round once host is full), and the stats are read once the daemon
is quiet (waited for with a bound).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
from concurrent_pages import BATCH, content, namespaces, round_keys, wrong_pages
from kvtier_client import KVTierClient, PageLayout
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import Conn, wait_for

PROCS = 4
LOAD_S = 5.0

WORKER = textwrap.dedent(
    """
    import json, random, sys, time
    sys.path.insert(0, sys.argv[5])
    import numpy as np
    from kvtier_client import CapacityError, KVTierClient, PageLayout, Tier
    from concurrent_pages import BATCH, content, namespaces, round_keys, wrong_pages

    target, me, procs, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    layout = PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16)
    rng = random.Random(me)
    report = {"rounds": 0, "written": 0, "lookups": 0, "verified": 0, "from_disk": 0, "prefetched": 0,
              "refused": 0, "wrong": 0, "wrong_sample": [], "errors": []}
    clients = {}
    try:
        for namespace in ("A", "B"):
            clients[namespace] = KVTierClient(target, name=f"writer-{me}-{namespace}")
            clients[namespace].register(namespace, layout)
        page_bytes = clients["A"].pool.page_bytes
        end = time.monotonic() + seconds
        rnd = 0
        while time.monotonic() < end:
            keys = round_keys(me, rnd)
            for namespace in namespaces(rnd):
                kv = clients[namespace]
                try:
                    lease = kv.borrow(BATCH)
                except CapacityError:
                    report["refused"] += 1
                    continue
                for page, key in zip(lease.pages, keys):
                    page.view(np.uint8).reshape(-1)[:] = content(namespace, key, page_bytes)
                lease.commit(keys)
                report["written"] += BATCH
                report["lookups"] += kv.lookup(keys).hit_blocks
            # a recent batch, this process's or another's, in a namespace that holds it
            proc = me if rng.random() < 0.7 else rng.randrange(procs)
            old = max(0, rnd - rng.randrange(1, 40))
            namespace = rng.choice(namespaces(old))
            old_keys = round_keys(proc, old)
            try:
                found, lease = clients[namespace].acquire_prefix(old_keys)
            except CapacityError:
                report["refused"] += 1
                lease = None
            if lease is not None:
                wrong = wrong_pages(lease, namespace, old_keys, page_bytes)
                report["wrong"] += len(wrong)
                report["wrong_sample"] = (report["wrong_sample"] + [[namespace, proc, old, *w] for w in wrong])[:10]
                report["verified"] += lease.ready
                report["from_disk"] += sum(t == Tier.DISK for t in found.tiers[: lease.ready])
                lease.release()
            if rnd % 4 == 3:
                report["prefetched"] += clients["A"].prefetch(round_keys(me, max(0, rnd - rng.randrange(20, 60))))
            if rnd % 5 == 4:
                try:
                    clients["A"].borrow(2).release()  # borrowed, never committed
                except CapacityError:
                    report["refused"] += 1
            rnd += 1
            report["rounds"] = rnd
    except BaseException as exc:
        report["errors"].append(repr(exc))
    finally:
        for kv in clients.values():
            kv.close()
    print(json.dumps(report), flush=True)
    """
)

LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16)
HERE = str(Path(__file__).resolve().parent)  # where the workers import concurrent_pages from


def _check_sums(stats: pb.StatsResponse) -> None:
    """docs/invariants.md, rules 8 and 9, on one snapshot (the store takes it under its lock)."""
    for pool in stats.pools:
        for t in pool.tiers:
            assert t.free_pages + t.writing_pages + t.cached_pages == t.capacity_pages, t
            assert t.cached_pages - t.pinned_pages - t.loading_pages - t.held_pages >= 0, t  # idle
            in_namespaces = sum(nt.pages for ns in pool.namespaces for nt in ns.tiers if nt.tier == t.tier)
            assert in_namespaces == t.cached_pages + t.writing_pages, (t, pool.namespaces)


def _quiet(conn: Conn) -> pb.StatsResponse | None:
    """The stats once nothing is in flight (no lease, load or disk write), else None."""
    stats = conn.call("Stats", pb.StatsRequest())
    busy = stats.leases or any(t.writing_pages or t.loading_pages for p in stats.pools for t in p.tiers)
    return None if busy else stats


def test_writer_processes_read_back_only_their_keys_bytes_and_the_stats_add_up(daemons, connect):
    d = daemons.start("--fsync", "never")  # 1 MiB host (256 pages), 4 MiB disk (1,024 pages)
    workers = [
        daemons.child(subprocess.Popen([sys.executable, "-c", WORKER, d.target, str(i), str(PROCS), str(LOAD_S), HERE],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for i in range(PROCS)
    ]
    conn = connect(d.target)
    snapshots = 0
    end = time.monotonic() + LOAD_S + 30  # (then `communicate` drains a worker stuck on a full pipe)
    while time.monotonic() < end and any(proc.poll() is None for proc in workers):  # the sums hold throughout
        _check_sums(conn.call("Stats", pb.StatsRequest()))
        snapshots += 1
        time.sleep(0.1)
    assert snapshots >= 10
    reports = []
    for proc in workers:
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for i, r in enumerate(reports):
        assert r["errors"] == [], (i, r["errors"], d.log()[-3000:])
        assert r["wrong"] == 0, (i, r["wrong"], r["wrong_sample"])  # (namespace, process, round, page, key)
        assert r["rounds"] >= 10 and r["verified"] > 0, (i, r)
    total = {k: sum(r[k] for r in reports) for k in ("written", "verified", "from_disk", "refused")}
    assert total["from_disk"] > 0, total  # pages were loaded back from disk and checked

    stats = wait_for(lambda: _quiet(conn), 15.0, "no lease, load or disk write in flight")
    assert stats.sessions == 0 and stats.leases == 0  # every client closed its sessions
    (pool,) = stats.pools
    tiers = {t.tier: t for t in pool.tiers}
    _check_sums(stats)
    for t in pool.tiers:
        assert t.pinned_pages == 0 and t.loading_pages == 0 and t.writing_pages == 0, t
        assert t.corrupt_pages == 0 and t.io_errors == 0, t
    host, disk = tiers[pb.TIER_HOST], tiers[pb.TIER_DISK]
    assert {ns.namespace for ns in pool.namespaces} == {"A", "B"}
    # The load went through disk: far more written than host holds, host pages evicted and
    # written to disk, disk pages evicted, pages loaded back into host.
    print(f"{PROCS} processes, {sum(r['rounds'] for r in reports)} rounds: {total}; host evictions {host.evictions}, "
          f"promotions {host.promotions}; disk demotions {disk.demotions}, evictions {disk.evictions}")
    assert total["written"] > 2 * disk.capacity_pages, total
    assert host.evictions > host.capacity_pages and disk.demotions > host.capacity_pages, host
    assert disk.evictions > 0 and host.promotions > 0, (host, disk)

    # Whatever is still cached, in either namespace, reads back as its own key's bytes, and
    # the daemon still serves a new client.
    checked = 0
    for namespace in ("A", "B"):
        with KVTierClient(d.target, name=f"checker-{namespace}") as kv:
            kv.register(namespace, LAYOUT)
            page_bytes = kv.pool.page_bytes
            for proc, report in enumerate(reports):
                for rnd in range(report["rounds"]):
                    if namespace not in namespaces(rnd):
                        continue
                    keys = round_keys(proc, rnd)
                    _found, lease = kv.acquire_prefix(keys)
                    if lease is not None:
                        with lease:
                            assert wrong_pages(lease, namespace, keys, page_bytes) == [], (namespace, proc, rnd)
                            checked += lease.ready
            if namespace == "A":
                keys = [b"after-the-load-%d" % i for i in range(BATCH)]
                with kv.borrow(BATCH) as lease:
                    for page, key in zip(lease.pages, keys):
                        page.view(np.uint8).reshape(-1)[:] = content(namespace, key, page_bytes)
                    lease.commit(keys)
                with kv.acquire(keys) as lease:
                    assert lease.ready == BATCH and wrong_pages(lease, namespace, keys, page_bytes) == []
    print(f"final sweep: {checked} cached pages read back right")
    assert checked > 0
    assert d.proc.poll() is None and "Traceback" not in d.log()
    stats = conn.call("Stats", pb.StatsRequest())
    assert stats.sessions == 0 and stats.leases == 0
    _check_sums(stats)
    assert all(t.corrupt_pages == 0 and t.io_errors == 0 for t in stats.pools[0].tiers)
