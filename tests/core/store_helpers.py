"""Helpers for the block-store tests: page patterns, whole-state snapshots, invariant checks."""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
from kvtier_client.tiers import Tier

from kvtier.core.invariants import check_invariants
from kvtier.server.pools import Pool


def pattern(key: bytes, nbytes: int, namespace: str = "") -> bytes:
    """Random-looking page bytes determined by (namespace, key): distinct for every page."""
    seed = int.from_bytes(hashlib.sha256(namespace.encode() + b"\0" + key).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def write_page(pool: Pool, slot: int, data: bytes) -> None:
    pool.host.page(slot)[:] = np.frombuffer(data, np.uint8)


def read_page(pool: Pool, slot: int) -> bytes:
    return pool.host.page(slot).tobytes()


def check(pool: Pool) -> None:
    check_invariants(pool.store, pool.disk.records() if pool.disk else None)


def snapshot(pool: Pool) -> dict:
    """Everything observable about a pool's state: a refused request must leave it equal."""
    store = pool.store
    return {
        "stats": dataclasses.asdict(store.stats()),
        "blocks": {
            ref: (b.parent, {t: (c.slot, c.pins, c.record) for t, c in b.copies.items()})
            for ref, b in store.blocks.items()
        },
        "leases": {i: dataclasses.asdict(lease) for i, lease in store.leases.items()},
        "sessions": {s: sorted(ids) for s, ids in store.sessions.items()},
        "free": {t: sorted(s.slots.free_slots()) for t, s in store.tiers.items()},
        "writing": {t: sorted(s.writing) for t, s in store.tiers.items()},
        # The full eviction order of each tier, as its policy would choose now.
        "order": {t: s.policy.victims(len(s.policy), lambda ref: False) for t, s in store.tiers.items()},
        "disk_index": set(pool.disk.records()) if pool.disk else None,
        "host_bytes": [host_slot(pool, s) for s in range(pool.host.pages)],
    }


def host_slot(pool: Pool, slot: int) -> tuple[str, str] | None:
    """Which namespace's memory a host slot is in, and a hash of its bytes (None: never given)."""
    try:
        memory = pool.host.holder(slot)
    except RuntimeError:
        return None
    return memory.namespace, hashlib.sha256(pool.host.view(slot)).hexdigest()


def tier_of(pool: Pool, namespace: str, key: bytes) -> set[Tier]:
    block = pool.store.blocks.get((namespace, key))
    return set(block.copies) if block else set()
