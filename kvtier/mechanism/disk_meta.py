"""The disk tier's meta table: which layout a directory holds, and the format versions of
its index and slab (kvtier.mechanism.formats), checked before anything else is read.

    meta key      value
    layout        repr(PageLayout)
    format        the index's format (DISK_INDEX); no entry: 1, written before seals;
                  2 is rewritten as 3 at open (`upgrade_entries`)
    slab_format   the slab's format (DISK_SLAB); no entry: 1, the slab as it has always been

A directory written by a newer kvtier is refused (DiskFormatRefused: one line, what was
found and what to do): at daemon start for every layout directory under cache_dir
(`check_cache_dir`, so `kvtier serve` exits 2 before it serves), and again when a pool
opens its tier. Pages in a format this kvtier no longer reads are forgotten at open (one
warning with their count; engines recompute them).
"""
from __future__ import annotations

import logging
import os

from kvtier_client.layout import PageLayout

from kvtier.core.chunks import chunk_bytes_for
from kvtier.mechanism.disk_index import upgrade_entries
from kvtier.mechanism.formats import DISK_INDEX, DISK_SLAB, Format, FormatRefused, Reading

log = logging.getLogger(__name__)

#: The index's LMDB environment in a layout's directory.
INDEX_DIR = "index.lmdb"
#: Each format of a disk tier directory and its meta key.
_VERSIONS: tuple[tuple[Format, bytes], ...] = ((DISK_INDEX, b"format"), (DISK_SLAB, b"slab_format"))


class DiskLayoutMismatch(RuntimeError):
    """The directory holds pages of another layout: an operator problem, not a client's."""


class DiskFormatRefused(DiskLayoutMismatch, FormatRefused):
    """The directory was written by a newer kvtier (a downgrade), or in no format kvtier knows."""


def _version(stored: bytes | None) -> int | None:
    if stored is None:
        return 1  # both formats' first version had no entry
    return int(stored) if stored.isdigit() else None


def _judge(get, directory: str) -> list[str]:
    """Refuse a format this kvtier cannot read; name those it no longer reads (to drop)."""
    dropped = []
    for fmt, key in _VERSIONS:
        found = _version(get(key))
        reading = fmt.reading(found)
        if reading is Reading.REFUSE:
            raise DiskFormatRefused(fmt.refusal(f"disk tier at {directory}", found, "move that directory away "
                                                "(or start with an empty --cache-dir) for an empty disk tier"))
        if reading is Reading.DROP:
            dropped.append(f"{fmt.name} format {found}")
    return dropped


def open_meta(env, pages, meta, directory: str, layout: PageLayout) -> None:
    """At open, in one transaction: check the formats (refuse, or forget the pages of one no
    longer read), then the layout; record the layout (a new directory) and the current formats."""
    with env.begin(write=True) as txn:
        dropped = _judge(lambda key: txn.get(key, db=meta), directory)
        stored, mine = txn.get(b"layout", db=meta), repr(layout).encode()
        if stored is not None and stored != mine:
            raise DiskLayoutMismatch(
                f"disk tier at {directory} holds pages of {stored.decode()}, not {layout}; "
                "point this layout at another directory or remove that one"
            )
        if _version(txn.get(b"format", db=meta)) == 2 and not dropped:  # read by rewriting it as format 3
            upgraded = upgrade_entries(txn, pages, layout.slot_bytes // chunk_bytes_for(layout.slot_bytes))
            if upgraded:
                log.info("disk tier %s: %d pages of disk index format 2 kept as format %d", directory, upgraded,
                         DISK_INDEX.current)
        if dropped:
            old = txn.stat(pages)["entries"]
            if old:
                log.warning("disk tier %s: forgetting %d pages of %s, which this kvtier no longer reads; engines "
                            "recompute them", directory, old, " and ".join(dropped))
            txn.drop(pages, delete=False)
        txn.put(b"layout", mine, db=meta)
        for fmt, key in _VERSIONS:
            txn.put(key, str(fmt.current).encode(), db=meta)


def check_cache_dir(cache_dir: str) -> None:
    """Refuse (DiskFormatRefused) a cache directory holding a layout's disk tier written by a
    newer kvtier. Reads each index's meta table only; an index that does not open is left
    to its tier's own open to report."""
    import lmdb  # here, not at module level: a daemon without a disk tier runs without lmdb

    for entry in sorted(os.scandir(cache_dir), key=lambda e: e.name):
        index = os.path.join(entry.path, INDEX_DIR)
        if not entry.is_dir() or not os.path.isfile(os.path.join(index, "data.mdb")):
            continue
        try:
            env = lmdb.open(index, readonly=True, lock=False, max_dbs=2)
        except lmdb.Error:
            continue
        try:
            with env.begin() as txn:
                try:
                    meta = env.open_db(b"meta", txn=txn, create=False)
                except lmdb.NotFoundError:
                    continue  # never opened as a tier: nothing in it yet
                _judge(lambda key, db=meta: txn.get(key, db=db), entry.path)
        finally:
            env.close()
