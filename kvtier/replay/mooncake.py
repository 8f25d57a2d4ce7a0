"""Replay a Mooncake-format trace (one JSON object per line with prefix-chained `hash_ids`,
one id per 512-token block) through a real BlockStore whose mover keeps only the books.

Per request, as the trace's README defines block hit rate: look up the ids, count the
cached prefix, then touch or insert every block in request order (acquire+release for a
cached block, which also promotes it from disk; borrow+commit for a new one).
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.core import BlockStore
from kvtier.core.bookkeeping import BookkeepingMover
from kvtier.policy import POLICIES, PolicyName

TRACE_BLOCK_TOKENS = 512
_NAMESPACE = "trace"
_SESSION = "replay"
#: The store needs a layout; replay moves no bytes, so any small one will do.
_LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=8, block_tokens=TRACE_BLOCK_TOKENS, dtype="uint8")


@dataclass(frozen=True)
class ReplayResult:
    requests: int
    blocks: int
    hit_blocks: int
    host_hit_blocks: int
    disk_hit_blocks: int
    host_pages: int
    disk_pages: int
    policy: str
    device_pages: int = 0
    device_hit_blocks: int = 0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "blocks": self.blocks,
            "policy": self.policy,
            "device_pages": self.device_pages,
            "host_pages": self.host_pages,
            "disk_pages": self.disk_pages,
            "block_hit_rate": self.block_hit_rate,
            "tier_hit_rates": {
                **({"device": self.device_hit_blocks / self.blocks if self.blocks else 0.0} if self.device_pages else {}),
                "host": self.host_hit_blocks / self.blocks if self.blocks else 0.0,
                "disk": self.disk_hit_blocks / self.blocks if self.blocks else 0.0,
            },
        }


def read_trace(path: str) -> Iterator[list[int]]:
    """The `hash_ids` of each request, in order.

    Every id is checked here, so a bad line is reported with its line number as a
    ValueError (one line from the CLI) instead of failing later inside the store.
    """
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                request = json.loads(line)
                if not isinstance(request, dict) or "hash_ids" not in request:
                    raise ValueError('no "hash_ids" field')
                ids = request["hash_ids"]
                if not isinstance(ids, list):
                    raise TypeError(f"hash_ids must be a list, got {type(ids).__name__}")
                bad = [i for i in ids if type(i) is not int or not 0 <= i < 2**64]
                if bad:
                    raise ValueError(f"hash id {bad[0]!r} is not an integer in [0, 2**64)")
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace line ({exc})") from None
            yield ids


def _key(hash_id: int) -> bytes:
    return hash_id.to_bytes(8, "little")


def replay(requests: Iterable[list[int]], *, host_pages: int, disk_pages: int = 0, policy: PolicyName | str = PolicyName.LRU,
           device_pages: int = 0) -> ReplayResult:
    """With `device_pages`, cached blocks are acquired into the device tier (as a GPU
    engine would), so they climb disk -> host -> device and fall back the same way."""
    store = BlockStore(_LAYOUT, host_pages=host_pages, disk_pages=disk_pages, device_pages=device_pages,
                       mover=BookkeepingMover(_LAYOUT.page_bytes), policy=POLICIES[PolicyName(policy)], prefetch_hold=0.0)
    read_into = Tier.DEVICE if device_pages else Tier.HOST
    n_requests = 0
    for ids in requests:
        n_requests += 1
        keys = [_key(i) for i in ids]
        store.lookup(_NAMESPACE, keys)
        parent: bytes | None = None
        for key in keys:
            if (_NAMESPACE, key) in store.blocks:
                lease = store.acquire(_SESSION, _NAMESPACE, [key], read_into)
                store.release(_SESSION, lease.lease_id)
            else:
                lease = store.borrow(_SESSION, _NAMESPACE, 1)
                store.commit(_SESSION, lease.lease_id, [key], parent=parent)
            parent = key
    stats = store.stats()
    host = stats.tier(Tier.HOST)
    disk = stats.tier(Tier.DISK)
    device = stats.tier(Tier.DEVICE)
    return ReplayResult(
        requests=n_requests,
        blocks=stats.lookup_blocks,
        hit_blocks=stats.lookup_blocks - stats.miss_blocks,
        host_hit_blocks=host.counters.hits,
        disk_hit_blocks=disk.counters.hits if disk else 0,
        host_pages=host_pages,
        disk_pages=disk_pages,
        policy=PolicyName(policy).value,
        device_pages=device_pages,
        device_hit_blocks=device.counters.hits if device else 0,
    )
