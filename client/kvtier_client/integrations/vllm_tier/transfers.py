"""The byte work of one job, on an I/O thread: rows of vLLM's CPU tier into kvtier pages
(borrow, copy with hashing, commit) and back (acquire the cached prefix, copy, release).

Both raise KVTierError for the job's runner to turn into a failed job.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier_client.client import KVTierClient
from kvtier_client.keys import BlockKey

#: Pages borrowed at a time: a large job does not need its whole size free in the host tier at once.
STORE_BATCH = 16


@dataclass(frozen=True)
class Moved:
    """How many of a job's rows were moved (the first `rows` of its keys), and their bytes."""

    rows: int
    bytes: int


def store_rows(kv: KVTierClient, keys: Sequence[BlockKey], rows: np.ndarray, chunk_ids: Sequence[int]) -> Moved:
    """Publish row `chunk_ids[i]` of `rows` as the page of `keys[i]`. A key the daemon already
    holds is reported a duplicate by the commit, and costs it nothing."""
    stored = 0
    for start in range(0, len(keys), STORE_BATCH):
        batch = keys[start : start + STORE_BATCH]
        with kv.borrow(len(batch)) as lease:
            for i, chunk in enumerate(chunk_ids[start : start + STORE_BATCH]):
                lease.write(i, rows[int(chunk)])
            lease.commit(batch)
        stored += len(batch)
    return Moved(stored, stored * rows.shape[1])


def load_rows(kv: KVTierClient, keys: Sequence[BlockKey], rows: np.ndarray, chunk_ids: Sequence[int]) -> Moved:
    """Copy the page of each key of the longest cached prefix of `keys` into row
    `chunk_ids[i]`; the pages are pinned only while they are copied."""
    found, lease = kv.acquire_prefix(list(keys))
    if lease is None:
        return Moved(0, 0)
    with lease:
        pages = lease.pages
        for i in range(found.hit_blocks):
            np.copyto(rows[int(chunk_ids[i])], pages[i].reshape(-1))
    return Moved(found.hit_blocks, found.hit_blocks * rows.shape[1])
