"""Keys and page bytes of tests/server/test_concurrent_writers.py, shared by the test and
its worker processes: every page's bytes are derived from its namespace and key, so a page
served under another key or namespace shows."""
from __future__ import annotations

import hashlib

import numpy as np

BATCH = 8


def round_keys(proc: int, rnd: int) -> list[bytes]:
    """The keys a worker process commits in one round."""
    return [hashlib.sha256(b"%d:%d:%d" % (proc, rnd, j)).digest()[:16] for j in range(BATCH)]


def namespaces(rnd: int) -> tuple[str, ...]:
    """Where a round's keys are committed: every third round in B too (with B's bytes)."""
    return ("A", "B") if rnd % 3 == 0 else ("A",)


def content(namespace: str, key: bytes, page_bytes: int) -> np.ndarray:
    seed = hashlib.sha256(namespace.encode() + b"/" + key).digest()
    return np.frombuffer(seed * (page_bytes // len(seed)), np.uint8)


def wrong_pages(lease, namespace: str, keys: list[bytes], page_bytes: int) -> list[tuple[int, str]]:
    """(index, key) of each ready page of a read lease whose bytes are not its key's."""
    return [(i, keys[i].hex()) for i, page in enumerate(lease.pages)
            if not np.array_equal(page.view(np.uint8).reshape(-1), content(namespace, keys[i], page_bytes))]
