"""What the KV event tests share: a SUB socket on a daemon's bound endpoint and committing a
prompt's blocks with their token ids (the fixtures `events_endpoint` and `subs` are in
conftest.py)."""
from __future__ import annotations

import time
from collections.abc import Iterator

import zmq
from kvtier_client import KVTierClient, PageLayout

LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16, dtype="float16")  # 3072-byte pages
BLOCK = LAYOUT.block_tokens


class Sub:
    """A SUB socket connected to a daemon's bound endpoint, subscribed to `prefix`."""

    def __init__(self, endpoint: str, prefix: bytes = b"") -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, prefix)

    def frames(self, seconds: float) -> Iterator[list[bytes]]:
        """Each message that arrives within `seconds`, as its frames."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.sub.poll(int(left * 1000)):
                yield self.sub.recv_multipart()

    def close(self) -> None:
        self.sub.close(linger=0)
        self.context.term()


def prompt(tag: int, blocks: int) -> list[int]:
    return [tag * 10_000 + i for i in range(blocks * BLOCK)]


def commit(kv: KVTierClient, tokens: list[int]) -> list[bytes]:
    """Commit a whole prompt's blocks with their token ids; returns their keys."""
    keys = kv.block_keys(tokens)
    with kv.borrow(len(keys)) as lease:
        kv.commit(lease, keys, token_ids=tokens)
    return keys
