"""One engine of `kvtier bench node`: a client process (`python -m kvtier_bench.node_engine`)
that serves the trace requests its router sends it, each the way an engine with kvtier
would, through its own KVTierClient on the fast lane:

    lookup(block keys) -> the cached prefix (the daemon's answer is the request's hits)
    acquire + release of that prefix, LEASE_PAGES pages per lease, each page's tag checked
    borrow + write + commit of the blocks after it, each page tagged with its key

A block key is the trace's block id as 16 bytes: the ids are already prefix-chained, as
the client's keys are. Every page carries its key in its first bytes, so an acquire that
returned another block's bytes fails the run instead of counting as a hit.

Commands on stdin, one JSON line of answer each on stdout:
    R <hash ids as JSON>   serve one request  -> {"hits", "blocks", "lost", "committed", "duplicates", "tiers"}
    quit                   close the client and exit
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from kvtier_client.layout import PageLayout

from kvtier_bench.harness import batches

#: 4 KiB pages: 512-token blocks of a 1-layer, 1-head, head_dim 4, uint8 model. The
#: benchmark measures hits, not bandwidth.
LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=4, block_tokens=512, dtype="uint8")
#: Pages per acquire or borrow: a request's prefix can be longer than one lease should pin.
LEASE_PAGES = 64


def block_key(hash_id: int) -> bytes:
    """A trace block id as a block key (16 bytes, the size of the client's xxh3-128 keys)."""
    return hash_id.to_bytes(16, "little")


def _tag(page: np.ndarray, key: bytes) -> None:
    page.reshape(-1)[:len(key)] = np.frombuffer(key, dtype=np.uint8)


def _carries(page: np.ndarray, key: bytes) -> bool:
    return page.reshape(-1)[:len(key)].tobytes() == key


def serve_request(kv, ids: list[int]) -> dict:
    """One request through `kv`. `hits` is the lookup's cached prefix less any block evicted
    between the lookup and its acquire (`lost`: those are recomputed and committed again)."""
    from kvtier_client import NotFound

    keys = [block_key(i) for i in ids]
    found = kv.lookup(keys)
    served = found.hit_blocks
    tiers: dict[str, int] = {}
    for start, n in batches(found.hit_blocks, LEASE_PAGES):
        try:
            with kv.acquire(keys[start:start + n]) as lease:
                for page, key in zip(lease.pages, keys[start:start + n]):
                    if not _carries(page, key):
                        raise RuntimeError(f"block {key.hex()} came back with another block's bytes")
        except NotFound:  # another engine's pages pushed it out after the lookup (a shared daemon)
            served = start
            break
    for tier in found.tiers[:served]:
        tiers[tier.label] = tiers.get(tier.label, 0) + 1
    duplicates = 0
    for start, n in batches(len(keys) - served, LEASE_PAGES):
        chunk = keys[served + start:served + start + n]
        with kv.borrow(n) as lease:
            for page, key in zip(lease.pages, chunk):
                _tag(page, key)
            parent = keys[served + start - 1] if served + start else None
            duplicates += len(lease.commit(chunk, parent=parent).duplicates)
    return {"hits": served, "blocks": len(keys), "lost": found.hit_blocks - served,
            "committed": len(keys) - served - duplicates, "duplicates": duplicates, "tiers": tiers}


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(target: str, namespace: str, index: int) -> None:
    from kvtier_client import KVTierClient

    kv = KVTierClient(target, name=f"bench-node-engine-{index}")
    try:
        kv.register(namespace, LAYOUT)
        _reply({"ready": True, "pid": os.getpid(), "transport": kv.transport})
        for line in sys.stdin:
            op, _, rest = line.partition(" ")
            if op.strip() == "quit":
                return
            if op != "R":
                raise ValueError(f"engine {index}: unknown command {line.strip()!r}")
            _reply(serve_request(kv, json.loads(rest)))
    finally:
        kv.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="an engine process of kvtier_bench.node (not for people)")
    parser.add_argument("--target", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--index", type=int, required=True)
    args = parser.parse_args()
    main(args.target, args.namespace, args.index)
