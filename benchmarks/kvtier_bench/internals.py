"""Everything the benchmarks take from inside the daemon package, in one place.

The benchmarks drive kvtier from outside (a `kvtier serve` subprocess and the client)
except where they measure a part on its own: the tiers and disk benchmarks build a real
pool in this process, the e2e benchmark starts a throwaway daemon, the trace benchmark
replays through the block index. What they use of the daemon's internals is imported
here and nowhere else, so a change inside kvtier/ breaks this one module first.
(The GPU tables, kvtier_bench.gpu, import the device tier themselves: they run on GPU
images that lack some of the daemon's dependencies.)
"""
from __future__ import annotations

import os

from kvtier_client.layout import PageLayout

from kvtier.child import ChildDaemon
from kvtier.core import WriteGrant
from kvtier.mechanism.directio import open_direct
from kvtier.mechanism.disk import FsyncPolicy
from kvtier.policy import PolicyName
from kvtier.server.pools import Pool, PoolConfig
from kvtier.replay.mooncake import TRACE_BLOCK_TOKENS, halfway, read_timed_trace, read_trace, replay
from kvtier.replay.policy import replay_policy
from kvtier.units import parse_size

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "ChildDaemon",
    "FsyncPolicy",
    "PolicyName",
    "Pool",
    "PoolConfig",
    "WriteGrant",
    "bench_pool",
    "open_direct",
    "parse_size",
    "halfway",
    "read_timed_trace",
    "read_trace",
    "replay",
    "replay_policy",
]


def bench_pool(layout: PageLayout, pages: int, workdir: str, namespace: str = "bench", **config) -> Pool:
    """A pool in this process whose host and disk tiers each hold exactly `pages` pages of
    `layout`: a real memfd host arena, the disk tier under `workdir`/tier, lru, write-back,
    fsync per batch; `config` sets other PoolConfig fields (or overrides these). Every host
    slot is given to `namespace` first, as the store does before a writer of it: the
    baselines copy into the slots directly."""
    pool = Pool(
        layout,
        PoolConfig(**{
            "host_bytes": pages * layout.slot_bytes,
            "disk_bytes": pages * layout.slot_bytes,
            "disk_dir": os.path.join(workdir, "tier"),
            "policy": "lru",
            "write_through": False,
            "fsync": "batch",
            "arena_prefix": f"kvtier-bench-{os.getpid()}",
            **config,
        }),
    )
    for slot in range(pages):  # what the store does on a slot's first borrow; it then finds them given
        pool.host.give(slot, namespace)
    return pool
