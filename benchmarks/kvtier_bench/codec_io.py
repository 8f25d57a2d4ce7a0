"""`kvtier bench codec-io`: what each page codec does to the time of the two reads it is
meant to speed up, through the real tiers, in one run.

disk     per codec, a fresh `Pool` whose disk tier writes pages with it (`CodecChoice`);
         the same KV-like pages committed to host, demoted to disk, evicted from host
         (disk-only), then one cold WAIT_ALL acquire of a 4,096-token prefix, timed
         (kvtier_bench.disk's repetition, reused). An identity pool stays open beside
         each codec's: every sample times identity, the codec and a raw O_DIRECT read of
         the prefix's raw bytes (io_depth threads), in an order that alternates, so the
         ratio codec / identity compares samples taken side by side. Target: <= 1.1.
cluster  per codec, a ClusterTier writing with it to a loopback Redis Cluster of real
         redis-server processes (each codec in its own namespace, all stored at once);
         `read_checked` of the pages in batches by a fresh client per sample (its
         connections opened before the clock starts), codecs in an order that reverses
         each sample. Target: a compressed get faster than raw (< 1). On loopback the
         "network" is a memcpy through the kernel, so fewer bytes buy little while the
         decode still costs: a real network makes the stored bytes count for more.

Pages are synthetic float16 KV (kvtier_bench.codecs.synthetic_kv: per-channel offsets and
log-normal scales, 4 outlier key channels per head at 15x). The lossy codecs' sizes are fixed
by the layout; zstd's ratio depends on the values (real KV may shrink more or less). Every
page read back is compared, outside the timings, with what the codec itself restores
(identity and zstd: the very bytes put). Nothing here asserts a speed.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import click
import numpy as np
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.codecs import CODECS, CodecChoice, codec_named
from kvtier.replay.codec import parse_layout
from kvtier.server.config import default_tiers
from kvtier.server.pools import Pool
from kvtier_bench.codec_pages import roundtrip
from kvtier_bench.codecs import synthetic_kv
from kvtier_bench.disk import DEFAULT_IO_DEPTH, _RawFile, _Rep, prefix_pages_for
from kvtier_bench.harness import (
    BATCH,
    bench_dir,
    describe_machine,
    filesystem_of,
    format_size,
    machine_description,
    utc_now,
)
from kvtier_bench.internals import FsyncPolicy

CODEC_NAMES = tuple(CODECS)  # identity, zstd, k16v8, fp8, int4, int8
#: Llama-3-8B's shape: 32 layers, 8 KV heads of 128, 16-token blocks, float16: 2 MiB pages.
DEFAULT_LAYOUT = PageLayout(layers=32, kv_heads=8, head_dim=128, block_tokens=16, dtype="float16")
#: --small: 4 layers, 256 KiB pages.
SMALL_LAYOUT = PageLayout(layers=4, kv_heads=8, head_dim=128, block_tokens=16, dtype="float16")
DEFAULT_SAMPLES = 5
CLUSTER_PAGES = 128
#: Distinct pages generated; page i is ring[i % RING].
RING = 32
DISK_TARGET, CLUSTER_TARGET = 1.1, 1.0
#: Mean |restored - put| / mean |put| above which a codec's pages are called wrong.
MAX_REL_ERROR = 0.25
_NS = "bench"


@dataclass(frozen=True)
class DiskRow:
    codec: str
    ratio: float  # raw bytes / stored bytes of the disk tier's pages (pool.usage())
    rel_error: float  # mean |restored - put| / mean |put|
    acquire_ms: float  # median cold WAIT_ALL acquire of the prefix
    identity_ms: float  # median of identity's samples taken beside this codec's
    raw_ms: float  # median raw O_DIRECT read of the prefix's raw bytes, same samples
    demote_ms: float  # one sample: every page demoted (encoded and written)

    @property
    def vs_identity(self) -> float:
        return self.acquire_ms / self.identity_ms


@dataclass(frozen=True)
class ClusterRow:
    codec: str
    ratio: float  # raw bytes / encoded bytes written (the tier's stats)
    rel_error: float
    get_ms_per_page: float  # median over samples
    identity_ms_per_page: float  # identity's median in the same samples

    @property
    def vs_identity(self) -> float:
        return self.get_ms_per_page / self.identity_ms_per_page


@dataclass(frozen=True)
class CodecIoResult:
    date: str
    machine: dict
    layout: PageLayout
    samples: int
    io_depth: int
    directory: str
    filesystem: str
    direct_io: bool
    prefix_pages: int
    cluster_pages: int
    server: str | None
    disk: tuple[DiskRow, ...] = ()
    cluster: tuple[ClusterRow, ...] = ()
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k not in ("disk", "cluster")},
                "layout": asdict(self.layout), "page_bytes": self.layout.page_bytes,
                "disk": [asdict(r) | {"vs_identity": r.vs_identity, "met": r.vs_identity <= DISK_TARGET}
                         for r in self.disk],
                "cluster": [asdict(r) | {"vs_identity": r.vs_identity,
                                         "met": r.vs_identity < CLUSTER_TARGET if r.codec != "identity" else None}
                            for r in self.cluster]}


# -- pages -------------------------------------------------------------------------------
def ring_pages(layout: PageLayout, n: int) -> np.ndarray:
    return synthetic_kv(layout, min(n, RING))


def expected_pages(layout: PageLayout, ring: np.ndarray, name: str) -> tuple[np.ndarray, float]:
    """What the codec restores for each ring page, and its mean relative error."""
    restored, _ = roundtrip(ring, layout, name)
    dtype = np.float16 if layout.dtype == "float16" else np.float32
    if layout.dtype not in ("float16", "float32"):
        return restored, float(not np.array_equal(restored, ring))
    a, b = ring.view(dtype).astype(np.float32), restored.view(dtype).astype(np.float32)
    return restored, float(np.abs(a - b).mean() / max(np.abs(a).mean(), 1e-30))


def check_error(name: str, rel_error: float) -> None:
    lossless = not codec_named(name, DEFAULT_LAYOUT).lossy
    if (lossless and rel_error) or rel_error > MAX_REL_ERROR:
        raise RuntimeError(f"codec {name} restores pages with a mean relative error of {rel_error:.3g}")


# -- disk ----------------------------------------------------------------------------------
class _DiskRep(_Rep):
    """kvtier_bench.disk's repetition on a pool whose disk tier writes with `codec`; pages
    read back are checked against what the codec restores (`expected`)."""

    def __init__(self, layout: PageLayout, pages: int, workdir: str, engine: np.ndarray, expected: np.ndarray,
                 codec: str, io_depth: int) -> None:
        self.layout, self.pages, self.prefix_pages, self.engine = layout, pages, pages, engine
        self.expected = expected
        self.keys = [i.to_bytes(8, "little") for i in range(pages)]
        tiers = default_tiers(
            host_size=pages * layout.slot_bytes, disk_size=pages * layout.slot_bytes,
            cache_dir=os.path.join(workdir, "tier"), policy="lru", disk_admission="all", write_through=False,
            fsync="batch", io_depth=io_depth, arena_prefix=f"kvtier-bench-{os.getpid()}-{codec}",
            max_queued_prefetch=max(pages, default_tiers().max_queued_prefetch), prefetch_hold=0.0)
        self.pool = Pool(layout, tiers, codecs=CodecChoice(codec))
        self.store, self.host = self.pool.store, self.pool.host
        try:
            for slot in range(pages):  # as bench_pool: the slots are the namespace's before the first borrow
                self.host.give(slot, _NS)
            if self.pool.disk is None:
                raise RuntimeError("the pool was built without a disk tier")
            self.disk = self.pool.disk
            self.raw = _RawFile(os.path.join(workdir, "raw.bin"), pages, layout.slot_bytes, io_depth,
                                FsyncPolicy.BATCH, self.pool.config.fsync_interval)
        except BaseException:
            self.pool.close()
            raise

    def setup(self, raw_too: bool) -> float:
        """Pages in host, demoted to disk (ms, returned), the raw file written, host emptied."""
        self._fill()
        demote = self._tier_write()
        if raw_too:
            self._raw_write()
        self._to_disk_only()
        return demote * 1e3

    def stored_ratio(self) -> float:
        disk = self.pool.usage().tier(Tier.DISK)
        if disk is None or not disk.stored_bytes:
            raise RuntimeError("the disk tier reports no stored bytes")
        return disk.cached * self.layout.page_bytes / disk.stored_bytes

    def acquire(self) -> float:
        return self._tier_acquire_all(self.keys, self._next_load_slots(self.pages))

    def raw_read(self) -> float:
        return self._raw_read(self._next_load_slots(self.pages))

    def _verify_tier(self, keys: list[bytes], slots: list[int]) -> None:
        lease = self.store.acquire(_NS, _NS, keys, timeout=0)
        try:
            if lease.ready != len(keys) or lease.promoted or list(lease.slots) != slots:
                raise RuntimeError(f"{len(keys) - lease.ready} of {len(keys)} pages not in host, or in other slots")
            for i, slot in enumerate(lease.slots):
                if not np.array_equal(self.host.page(slot), self.expected[i % len(self.expected)]):
                    raise RuntimeError(f"page {i} came back from the disk tier other than its codec restores it")
        finally:
            self.store.release(_NS, lease.lease_id)
        if self.disk.corrupt_pages:
            raise RuntimeError(f"{self.disk.corrupt_pages} pages failed their checksum")


def run_disk_part(layout: PageLayout, codecs: Sequence[str], root: str, samples: int, io_depth: int,
                  progress: Callable[[str], None]) -> tuple[list[DiskRow], int, bool]:
    """(rows, prefix pages, O_DIRECT used by both sides)."""
    pages = prefix_pages_for(layout, 1 << 62)
    ring = ring_pages(layout, pages)
    expected = {name: expected_pages(layout, ring, name) for name in dict.fromkeys(("identity", *codecs))}
    for name, (_, err) in expected.items():
        check_error(name, err)
    progress(f"codec-io disk: {pages} pages of {format_size(layout.page_bytes)} per acquire, {samples} samples")
    base = _DiskRep(layout, pages, _workdir(root, "identity"), ring, expected["identity"][0], "identity", io_depth)
    rows, direct = [], True
    try:
        base_demote = base.setup(raw_too=True)
        direct = base.direct_io
        for name in codecs:
            rep = base if name == "identity" else _DiskRep(layout, pages, _workdir(root, name), ring,
                                                           expected[name][0], name, io_depth)
            try:
                demote = base_demote if rep is base else rep.setup(raw_too=False)
                direct = direct and rep.disk.direct_io
                times: dict[str, list[float]] = {"codec": [], "identity": [], "raw": []}
                for s in range(samples):
                    order = [("identity", base.acquire), ("codec", rep.acquire), ("raw", base.raw_read)]
                    for side, fn in (order if s % 2 == 0 else order[::-1]):
                        times[side].append(fn() * 1e3)
                med = {k: statistics.median(v) for k, v in times.items()}
                rows.append(DiskRow(name, rep.stored_ratio(), expected[name][1], med["codec"], med["identity"],
                                    med["raw"], demote))
                progress(f"codec-io disk: {name}: {med['codec']:.1f} ms, identity {med['identity']:.1f} ms, "
                         f"raw {med['raw']:.1f} ms")
            finally:
                if rep is not base:
                    rep.close()
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    finally:
        base.close()
    return rows, pages, direct


def _workdir(root: str, name: str) -> str:
    os.makedirs(os.path.join(root, name), exist_ok=True)
    return os.path.join(root, name)


# -- the run -------------------------------------------------------------------------------
def run_codec_io(layout: PageLayout = DEFAULT_LAYOUT, codecs: Sequence[str] = CODEC_NAMES, *,
                 parts: Sequence[str] = ("disk", "cluster"), samples: int = DEFAULT_SAMPLES,
                 io_depth: int = DEFAULT_IO_DEPTH, cluster_pages: int = CLUSTER_PAGES, directory: str | None = None,
                 cluster=None, progress: Callable[[str], None] = lambda line: None) -> CodecIoResult:
    """Both parts; `cluster` a running LocalRedisCluster to use (else one is started here)."""
    from kvtier_bench import codec_io_cluster
    from kvtier_bench.peers.redis import version as redis_version
    from kvtier_bench.redis_cluster import LocalRedisCluster

    if samples <= 0 or io_depth <= 0 or cluster_pages <= 0:
        raise ValueError("samples, io_depth and cluster pages must be positive")
    unknown = [c for c in codecs if c not in CODECS]
    if unknown:
        raise ValueError(f"unknown codec(s) {', '.join(unknown)}: choose from {', '.join(CODECS)}")
    codecs = list(dict.fromkeys(codecs))
    parent = bench_dir(directory)
    root = tempfile.mkdtemp(prefix="kvtier-bench-codec-io-", dir=parent)
    disk_rows, cluster_rows, prefix, direct, server = [], [], 0, True, None
    try:
        if "disk" in parts:
            disk_rows, prefix, direct = run_disk_part(layout, codecs, root, samples, io_depth, progress)
        if "cluster" in parts:
            server = redis_version()
            if cluster is not None:
                cluster_rows = codec_io_cluster.run_cluster_part(cluster, layout, codecs, cluster_pages, samples,
                                                                 progress)
            else:
                progress("codec-io cluster: starting a loopback Redis Cluster of 3 masters")
                with LocalRedisCluster.start(os.path.join(root, "redis"), masters=3) as started:
                    cluster_rows = codec_io_cluster.run_cluster_part(started, layout, codecs, cluster_pages, samples,
                                                                     progress)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    notes = [("pages: synthetic float16 KV with 4 outlier key channels per head (kvtier_bench.codecs.synthetic_kv); "
              "the lossy codecs' ratios are fixed by the layout, zstd's depends on the values (random mantissas "
              "barely compress; real KV may shrink more)")]
    if cluster_rows:
        notes.append("cluster: loopback Redis Cluster on this machine: the 'network' is a memcpy through the kernel, "
                     "so a smaller value saves little while its decode still costs; across a real network the "
                     "stored bytes weigh more")
    fs = filesystem_of(parent)
    if fs.split()[0] in ("tmpfs", "ramfs"):
        notes.append(f"{parent} is on tmpfs: the disk rows measure memory")
    if disk_rows and not direct:
        notes.append("O_DIRECT was refused: both sides used buffered I/O with the page cache dropped before each read")
    return CodecIoResult(utc_now(), machine_description(directory), layout, samples, io_depth, parent, fs, direct,
                         prefix, cluster_pages if cluster_rows else 0, server, tuple(disk_rows), tuple(cluster_rows),
                         notes)


# -- output --------------------------------------------------------------------------------
def _rows(result: CodecIoResult) -> tuple[list[list[str]], list[list[str]]]:
    disk = [["codec", "ratio", "rel err", "acquire ms", "x identity", "raw O_DIRECT ms", "demote ms"]]
    disk += [[r.codec, f"{r.ratio:.2f}", f"{r.rel_error:.4f}", f"{r.acquire_ms:,.1f}", f"{r.vs_identity:.2f}",
              f"{r.raw_ms:,.1f}", f"{r.demote_ms:,.0f}"] for r in result.disk]
    cluster = [["codec", "ratio", "rel err", "get ms/page", "x identity"]]
    cluster += [[r.codec, f"{r.ratio:.2f}", f"{r.rel_error:.4f}", f"{r.get_ms_per_page:.3f}",
                 f"{r.vs_identity:.2f}"] for r in result.cluster]
    return disk, cluster


def _headers(result: CodecIoResult) -> list[str]:
    lay = result.layout
    out = [(f"layout {lay.layers} layers x {lay.kv_heads} kv heads x {lay.head_dim} x {lay.block_tokens} tokens "
            f"{lay.dtype}: {format_size(lay.page_bytes)} pages; median of {result.samples} samples")]
    if result.disk:
        out.append(f"disk: cold WAIT_ALL acquire of {result.prefix_pages} disk-only pages "
                   f"({result.prefix_pages * lay.block_tokens:,} tokens), io_depth {result.io_depth}, "
                   f"{result.directory} ({result.filesystem}), O_DIRECT {'yes' if result.direct_io else 'NO'}; "
                   f"x identity target <= {DISK_TARGET}; raw = pread of the same raw bytes, same samples")
    if result.cluster:
        out.append(f"cluster: read_checked of {result.cluster_pages} pages, {BATCH} per batch, fresh client per "
                   f"sample, 3-master loopback Redis Cluster ({result.server}); x identity target < {CLUSTER_TARGET}")
    return out


def _text_table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]


def format_table(result: CodecIoResult) -> str:
    disk, cluster = _rows(result)
    lines = [f"kvtier bench codec-io, {result.date}", describe_machine(result.machine), *_headers(result), ""]
    for rows in (disk if result.disk else None, cluster if result.cluster else None):
        if rows:
            lines += _text_table(rows) + [""]
    return "\n".join(lines + [f"note: {n}" for n in result.notes])


def format_markdown(result: CodecIoResult, command_line: str) -> str:
    lines = [f"`{command_line}` ({result.date})", "", describe_machine(result.machine), "",
             *(f"- {h}" for h in _headers(result)), ""]
    disk, cluster = _rows(result)
    for title, rows in (("Disk", disk if result.disk else None), ("Cluster", cluster if result.cluster else None)):
        if rows:
            lines += [f"**{title}**", "", "| " + " | ".join(rows[0]) + " |", "|---|" + "---:|" * (len(rows[0]) - 1)]
            lines += ["| " + " | ".join(r) + " |" for r in rows[1:]] + [""]
    return "\n".join(lines + [f"- {n}" for n in result.notes]) + "\n"


@click.command("codec-io", short_help="Disk acquire and cluster get of compressed pages vs raw pages.")
@click.option("--codec", "codecs", type=click.Choice(CODEC_NAMES), multiple=True,
              help="Only these codecs (identity, the reference, always runs); repeatable  [default: all]")
@click.option("--part", "parts", type=click.Choice(["disk", "cluster"]), multiple=True,
              help="Only this part; repeatable  [default: both]")
@click.option("--layout", "layout_text", default="", metavar="FIELDS",
              help="Page layout, e.g. 'layers=32,kv_heads=8,head_dim=128,block_tokens=16,dtype=float16'.")
@click.option("--small", is_flag=True, help="4 layers instead of 32: 256 KiB pages.")
@click.option("--samples", type=click.IntRange(min=1), default=DEFAULT_SAMPLES, show_default=True)
@click.option("--io-depth", type=click.IntRange(min=1), default=DEFAULT_IO_DEPTH, show_default=True)
@click.option("--cluster-pages", type=click.IntRange(min=1), default=CLUSTER_PAGES, show_default=True)
@click.option("--dir", "directory", type=click.Path(exists=True, file_okay=False, writable=True),
              help="Where the disk tiers, raw file and cluster nodes go  [default: /var/tmp]")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the tables as markdown here.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def command(codecs: tuple[str, ...], parts: tuple[str, ...], layout_text: str, small: bool, samples: int,
            io_depth: int, cluster_pages: int, directory: str | None, markdown_path: str | None,
            as_json: bool) -> None:
    """Per codec, a cold WAIT_ALL acquire of a 4,096-token prefix from disk-only pages through
    a real pool (x identity, target <= 1.1, next to a raw O_DIRECT read of the raw bytes),
    and a cluster get of pages through the ClusterTier on a loopback Redis Cluster (x
    identity, target < 1), with each codec's measured ratio and error."""
    from kvtier_bench.cluster import server_missing

    parts = parts or ("disk", "cluster")
    if "cluster" in parts and server_missing():
        raise click.ClickException(server_missing())
    try:
        layout = parse_layout(layout_text) if layout_text else (SMALL_LAYOUT if small else DEFAULT_LAYOUT)
        result = run_codec_io(layout, ("identity", *codecs) if codecs else CODEC_NAMES, parts=parts, samples=samples,
                              io_depth=io_depth, cluster_pages=cluster_pages,
                              directory=os.path.abspath(directory) if directory else None,
                              progress=lambda line: None if as_json else click.echo(line, err=True))
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if markdown_path:
        with open(markdown_path, "w") as f:
            args = sys.argv[sys.argv.index("codec-io") + 1:] if "codec-io" in sys.argv else []
            f.write(format_markdown(result, " ".join(["kvtier bench codec-io", *args])))
    click.echo(json.dumps(result.as_dict()) if as_json else format_table(result))
