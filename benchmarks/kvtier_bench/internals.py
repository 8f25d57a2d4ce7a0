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
from kvtier.policy import POLICIES as POLICY_REGISTRY
from kvtier.server.config import default_tiers
from kvtier.server.pools import Pool
from kvtier.replay.codec import CODECS, DEFAULT_LAYOUT, CodecRatio, describe, measure_ratio, parse_layout
from kvtier.replay.mooncake import TRACE_BLOCK_TOKENS, halfway, read_timed_trace, read_trace, replay
from kvtier.replay.policy import replay_policy
from kvtier.units import parse_size

__all__ = [
    "CODECS",
    "DEFAULT_LAYOUT",
    "TRACE_BLOCK_TOKENS",
    "CodecRatio",
    "ChildDaemon",
    "FsyncPolicy",
    "POLICY_REGISTRY",
    "Pool",
    "WriteGrant",
    "bench_pool",
    "default_tiers",
    "describe",
    "measure_ratio",
    "parse_layout",
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
    `layout`: a real memfd host arena, the disk tier under `workdir`/tier, lru, every page
    admitted to disk, write-back, fsync per batch; `config` sets other TiersConfig fields
    (or overrides these). Every host slot is given to `namespace` first, as the store does
    before a writer of it: the baselines copy into the slots directly."""
    pool = Pool(
        layout,
        default_tiers(**{
            "host_size": pages * layout.slot_bytes,
            "disk_size": pages * layout.slot_bytes,
            "cache_dir": os.path.join(workdir, "tier"),
            "policy": "lru",
            "disk_admission": "all",
            "write_through": False,
            "fsync": "batch",
            "arena_prefix": f"kvtier-bench-{os.getpid()}",
            **config,
        }),
    )
    for slot in range(pages):  # what the store does on a slot's first borrow; it then finds them given
        pool.host.give(slot, namespace)
    return pool
