"""The cluster part of `kvtier bench codec-io` (kvtier_bench.codec_io): each codec's pages
written through a ClusterTier to a loopback Redis Cluster, then read back with
`read_checked` by a fresh client per sample, every codec once per sample."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
from kvtier_client.layout import PageLayout

from kvtier.codecs import CodecChoice
from kvtier_bench.codec_io import ClusterRow, check_error, expected_pages, ring_pages
from kvtier_bench.harness import BATCH, format_size


def run_cluster_part(cluster, layout: PageLayout, codecs: Sequence[str], pages: int, samples: int,
                     progress: Callable[[str], None]) -> list[ClusterRow]:
    """Each codec's pages in namespace `codec` on `cluster` (a LocalRedisCluster), then
    timed gets, every codec once per sample."""
    from kvtier.mechanism.cluster import ClusterTier, RedisClusterStore

    def tier(codec: str = "identity") -> ClusterTier:
        return ClusterTier(RedisClusterStore(cluster.url, timeout=60.0), layout=layout, codecs=CodecChoice(codec))

    names = list(dict.fromkeys(("identity", *codecs)))
    ring = ring_pages(layout, pages)
    keys = [i.to_bytes(16, "little") for i in range(pages)]
    ratio, expected = {}, {}
    for name in names:
        expected[name] = expected_pages(layout, ring, name)
        check_error(name, expected[name][1])
        writer = tier(name)
        try:
            for s in range(0, pages, BATCH):
                n = min(BATCH, pages - s)
                if writer.write(name, [(keys[i], memoryview(ring[i % len(ring)])) for i in range(s, s + n)]) != n:
                    raise RuntimeError(f"the cluster tier stored fewer than {n} pages: {dict(writer.stats().faults)}")
            st = writer.stats()
            ratio[name] = st.bytes_written / st.stored_bytes_written
        finally:
            writer.close()
    progress(f"codec-io cluster: {pages} pages of {format_size(layout.page_bytes)} per codec written")
    sink = np.zeros((pages, layout.page_bytes), np.uint8)
    views = [memoryview(row) for row in sink]

    def get(name: str) -> float:
        reader = tier()
        try:
            if reader.present(name, keys) != pages:  # untimed: opens the connection to every node
                raise RuntimeError(f"the cluster holds fewer than {pages} pages of {name}")
            start = time.perf_counter()
            for s in range(0, pages, BATCH):
                ok = reader.read_checked(name, keys[s:s + BATCH], views[s:s + BATCH])
                if any(c is None for c in ok):
                    raise RuntimeError(f"{name}: a page was not read back: {dict(reader.stats().faults)}")
            seconds = time.perf_counter() - start
        finally:
            reader.close()
        want = expected[name][0]
        for i in range(pages):
            if not np.array_equal(sink[i], want[i % len(want)]):
                raise RuntimeError(f"{name}: page {i} came back from the cluster other than its codec restores it")
        return seconds * 1e3 / pages

    for name in names:  # untimed: first touches of the sink and of each namespace's values
        get(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for s in range(samples):
        for name in (names if s % 2 == 0 else names[::-1]):
            times[name].append(get(name))
    med = {name: statistics.median(v) for name, v in times.items()}
    rows = [ClusterRow(name, ratio[name], expected[name][1], med[name], med["identity"]) for name in codecs]
    progress("codec-io cluster: " + ", ".join(f"{r.codec} {r.get_ms_per_page:.2f} ms/page" for r in rows))
    return rows
