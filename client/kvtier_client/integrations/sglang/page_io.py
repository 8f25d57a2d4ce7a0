"""Pages between tensors in kvtier's order (views of SGLang's host pool, host_pages.py) and
the daemon: a store borrows free pages, copies into them and commits them under their keys;
a load acquires the cached prefix and copies out of it. One copy each way, a torch copy
between the pool and the mapped arena; at most `batch` pages are held at a time.

Both answer per page, as SGLang's `batch_set_v1` / `batch_get_v1` do: a kvtier error ends the
batch there (logged), and the pages after it are False.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier_client.client import KVTierClient
from kvtier_client.errors import KVTierError
from kvtier_client.keys import BlockKey

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvtier_client.sglang")


def _chunks(count: int, batch: int) -> range:
    return range(0, count, batch)


def store(client: KVTierClient, keys: Sequence[BlockKey], pages: Sequence[torch.Tensor], *,
          parent: BlockKey | None, batch: int) -> list[bool]:
    """Store pages[i] under keys[i]. The cached prefix is not copied again (its pages are
    already there); a key cached meanwhile is a duplicate the daemon drops, also a success."""
    done = [False] * len(keys)
    try:
        cached = client.lookup(keys).hit_blocks
    except KVTierError as exc:
        log.warning("kvtier HiCache backend: lookup before storing %d pages failed: %s", len(keys), exc)
        return done
    done[:cached] = [True] * cached
    for start in _chunks(len(keys) - cached, batch):
        first = cached + start
        chunk = list(keys[first : first + batch])
        before = keys[first - 1] if first else parent
        try:
            with client.borrow(len(chunk)) as lease:
                for page, source in zip(lease.tensors(), pages[first : first + len(chunk)]):
                    page.copy_(source)
                client.commit(lease, chunk, parent=before)
        except KVTierError as exc:
            log.warning("kvtier HiCache backend: storing pages %d-%d of %d failed: %s",
                        first, first + len(chunk) - 1, len(keys), exc)
            break
        done[first : first + len(chunk)] = [True] * len(chunk)
    return done


def load(client: KVTierClient, keys: Sequence[BlockKey], pages: Sequence[torch.Tensor], *, batch: int) -> list[bool]:
    """Copy the cached prefix of `keys` into pages[i] (loading it from disk first where it is
    there); True for each page copied."""
    done = [False] * len(keys)
    for first in _chunks(len(keys), batch):
        chunk = list(keys[first : first + batch])
        try:
            found, lease = client.acquire_prefix(chunk)
            if lease is not None:
                with lease:
                    for page, target in zip(lease.tensors(), pages[first : first + found.hit_blocks]):
                        target.copy_(page)
        except KVTierError as exc:
            log.warning("kvtier HiCache backend: loading pages %d-%d of %d failed: %s",
                        first, first + len(chunk) - 1, len(keys), exc)
            break
        done[first : first + found.hit_blocks] = [True] * found.hit_blocks
        if found.hit_blocks < len(chunk):
            break
    return done
