"""`kvtier bench codecs`: each page codec's ratio and encode/decode speed, against a memcpy
and a raw O_DIRECT disk read measured in the same run.

Decoding is on the read path of every compressed page: a page read from disk compressed is
worth it when reading its fewer bytes and decoding them takes less time than reading the
raw page. So the table puts each codec's decode rate next to the disk's read rate (one
reader, O_DIRECT, the disk tier's read path without its index: `probe_disk_reads`) and
gives the serial read-then-decode rate of a page (what one core gets from the disk).

The KV is synthetic (real KV is not in the repository): per channel, keys have an offset
and a log-normal scale, with 4 outlier channels per head at 15x; values are zero-mean with
smaller log-normal scales. The lossy codecs' sizes are fixed, so their ratios hold for any
KV; zstd's ratio depends on the values (bfloat16 KV, with fewer mantissa bits, shrinks
more). Every figure is the best of `reps` passes over a working set larger than the caches
(each pass writes into pages that the previous one left cold).
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import click
import ml_dtypes
import numpy as np
from kvtier_client.layout import PageLayout

from kvtier.codecs import CODECS, codec_named, decoder
from kvtier.mechanism.bandwidth import probe_disk_reads
from kvtier.mechanism.directio import open_direct
from kvtier_bench.harness import MiB, bench_dir, format_size

#: 28 layers, 8 KV heads of 128, 16-token blocks: 1.75 MiB a page in 16 bits.
DEFAULT_LAYOUT = PageLayout(layers=28, kv_heads=8, head_dim=128, block_tokens=16)
DEFAULT_WORKING_SET = 256 * MiB
DEFAULT_DTYPES = ("float16", "bfloat16")
DEFAULT_REPS = 3
_NUMPY = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
#: Distinct pages generated; the working set repeats them in distinct memory.
_DISTINCT = 8


def synthetic_kv(layout: PageLayout, pages: int, seed: int = 0) -> np.ndarray:
    """`pages` pages of KV-like values, [pages, page_bytes] uint8 (see the module docstring)."""
    rng = np.random.default_rng(seed)
    lay, tok, heads, dim = layout.layers, layout.block_tokens, layout.kv_heads, layout.head_dim
    key_scale = rng.lognormal(0.0, 0.5, (lay, 1, heads, dim))
    outliers = rng.random((lay, 1, heads, dim)).argsort(axis=-1) < 4
    key_scale = np.where(outliers, key_scale * 15, key_scale)
    key_mean = rng.normal(0, 1, (lay, 1, heads, dim)) * key_scale
    value_scale = rng.lognormal(-1.0, 0.3, (lay, 1, heads, dim))
    out = np.empty((pages, layout.page_bytes), np.uint8)
    for p in range(pages):
        keys = key_mean + rng.standard_normal((lay, tok, heads, dim)) * key_scale
        values = rng.standard_normal((lay, tok, heads, dim)) * value_scale
        parts = np.stack([keys, values], axis=1) if layout.kv_parts == 2 else keys
        out[p] = parts.astype(_NUMPY.get(layout.dtype, np.float32)).reshape(-1).view(np.uint8)[: layout.page_bytes]
    return out


@dataclass(frozen=True)
class CodecRow:
    codec: str
    dtype: str
    ratio: float
    encode_gbs: float  # page bytes encoded per second, one thread
    decode_gbs: float  # page bytes decoded per second, one thread
    decode2_gbs: float  # the same, two threads together
    disk_gbs: float  # the raw disk read rate of the same run (one reader)
    encode_cpu_gbs: float  # page bytes encoded per CPU second: the rate of one core of its own
    decode_cpu_gbs: float
    decode2_parallel: float  # CPU seconds per second while two threads decode (2: no GIL, no waits)

    @property
    def decode_vs_disk(self) -> float:
        """One core's decode rate over one reader's disk rate (over 1: decoding keeps up)."""
        return self.decode_cpu_gbs / self.disk_gbs

    @property
    def read_decode_gbs(self) -> float:
        """Page bytes per second of reading the encoded page from disk, then decoding it, on
        one thread one after the other (identity: the disk rate, read straight into the page)."""
        if self.codec == "identity":
            return self.disk_gbs
        return 1 / (1 / (self.ratio * self.disk_gbs) + 1 / self.decode_cpu_gbs)

    def as_dict(self) -> dict:
        return asdict(self) | {"decode_vs_disk": self.decode_vs_disk, "read_decode_gbs": self.read_decode_gbs}


@dataclass
class CodecBenchResult:
    layout: PageLayout
    working_set: int
    pages: int
    memcpy_gbs: float
    memcpy2_gbs: float
    disk_gbs: float
    disk2_gbs: float
    direct: str
    rows: list[CodecRow] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"layout": asdict(self.layout), "working_set": self.working_set, "pages": self.pages,
                "memcpy_gbs": self.memcpy_gbs, "memcpy2_gbs": self.memcpy2_gbs, "disk_gbs": self.disk_gbs,
                "disk2_gbs": self.disk2_gbs, "disk_reads": self.direct, "rows": [r.as_dict() for r in self.rows]}


def _best(reps: int, fn: Callable[[], None]) -> tuple[float, float, float]:
    """The fewest seconds of `reps` runs of `fn`, by the clock and in this process's CPU time
    (on a machine shared with other work, the CPU time still says what a core of its own does),
    and CPU time over clock time over all runs (above 1: threads ran at once, the GIL released)."""
    wall = cpu = float("inf")
    walls = cpus = 0.0
    for _ in range(reps):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        w, c = time.perf_counter() - start, time.process_time() - start_cpu
        wall, cpu, walls, cpus = min(wall, w), min(cpu, c), walls + w, cpus + c
    return wall, max(cpu, 1e-9), cpus / max(walls, 1e-9)


def _threads(n: int, work: Callable[[int, int], None], items: int) -> Callable[[], None]:
    """A function running work(start, stop) over `items` split among `n` threads."""
    bounds = [(i * items // n, (i + 1) * items // n) for i in range(n)]
    if n == 1:
        return lambda: work(0, items)

    def run() -> None:
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda b: work(*b), bounds))

    return run


def _direct_io(directory: str) -> str:
    path = os.path.join(directory, f".codec-bench-probe-{os.getpid()}")
    fd, direct = open_direct(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    os.close(fd)
    os.unlink(path)
    return "O_DIRECT" if direct else "buffered (page cache dropped)"


def _measure(name: str, lay: PageLayout, distinct: np.ndarray, raw: np.ndarray, reps: int, disk_gbs: float) -> CodecRow:
    """One row: `name` encoding every page of `raw`, then decoding them into cold pages."""
    pages = len(raw)
    codec = codec_named(name, lay)
    encoded = [codec.encode(memoryview(page)) for page in distinct]
    stored = [bytes(encoded[i % len(encoded)].data) for i in range(pages)]  # distinct memory each
    decoders = [decoder(encoded[i % len(encoded)].codec, lay) for i in range(pages)]
    out = np.zeros_like(raw)

    def encode(a: int, b: int) -> None:
        for i in range(a, b):
            codec.encode(memoryview(raw[i]))

    def decode(a: int, b: int) -> None:
        for i in range(a, b):
            if not decoders[i].decode_into(stored[i], memoryview(out[i])):
                raise RuntimeError(f"{name}: page {i} did not decode")

    nbytes = pages * lay.page_bytes
    encode_s, decode_s = _best(reps, _threads(1, encode, pages)), _best(reps, _threads(1, decode, pages))
    decode2_s = _best(reps, _threads(2, decode, pages))
    row = CodecRow(name, lay.dtype, ratio=lay.page_bytes * len(encoded) / sum(len(e.data) for e in encoded),
                   encode_gbs=nbytes / encode_s[0] / 1e9, decode_gbs=nbytes / decode_s[0] / 1e9,
                   decode2_gbs=nbytes / decode2_s[0] / 1e9, disk_gbs=disk_gbs, encode_cpu_gbs=nbytes / encode_s[1] / 1e9,
                   decode_cpu_gbs=nbytes / decode_s[1] / 1e9, decode2_parallel=decode2_s[2])
    if not codec.lossy and not np.array_equal(out, raw):
        raise RuntimeError(f"{name} {lay.dtype}: a lossless codec changed the page")
    return row


def run_codecs(layout: PageLayout = DEFAULT_LAYOUT, dtypes: Sequence[str] = DEFAULT_DTYPES,
               working_set: int = DEFAULT_WORKING_SET, reps: int = DEFAULT_REPS, directory: str | None = None,
               codecs: Sequence[str] = tuple(CODECS), progress: Callable[[str], None] = lambda line: None) -> CodecBenchResult:
    """The codec table: every codec over `dtypes`, against memcpy and raw disk reads."""
    directory = bench_dir(directory)
    pages = max(2, working_set // layout.page_bytes)
    src = np.empty((pages, layout.page_bytes), np.uint8)
    dst = np.empty_like(src)
    dst.fill(0)
    src.fill(0)

    def copy(a: int, b: int) -> None:
        np.copyto(dst[a:b], src[a:b])

    progress(f"memcpy and disk reads: {pages} pages of {format_size(layout.page_bytes)}")
    result = CodecBenchResult(
        layout, pages * layout.page_bytes, pages,
        memcpy_gbs=src.nbytes / _best(reps, _threads(1, copy, pages))[1] / 1e9,
        memcpy2_gbs=src.nbytes / _best(reps, _threads(2, copy, pages))[0] / 1e9,
        disk_gbs=max(probe_disk_reads(directory, layout.slot_bytes, 1, pages * layout.slot_bytes) for _ in range(reps)) / 1e9,
        disk2_gbs=max(probe_disk_reads(directory, layout.slot_bytes, 2, pages * layout.slot_bytes) for _ in range(reps)) / 1e9,
        direct=_direct_io(directory))
    for dtype in dtypes:
        lay = PageLayout(layout.layers, layout.kv_heads, layout.head_dim, layout.block_tokens, dtype, layout.order)
        distinct = synthetic_kv(lay, min(_DISTINCT, pages))
        raw = np.empty((pages, lay.page_bytes), np.uint8)
        for i in range(pages):
            raw[i] = distinct[i % len(distinct)]
        for name in codecs:
            progress(f"{name} {dtype}")
            result.rows.append(_measure(name, lay, distinct, raw, reps, result.disk_gbs))
    return result


def format_table(result: CodecBenchResult) -> str:
    lay = result.layout
    head = (f"Page codecs on {lay.layers} layers x {lay.kv_heads} KV heads x {lay.head_dim} x {lay.block_tokens} "
            f"tokens ({format_size(lay.page_bytes)} in 16 bits), {result.pages} pages "
            f"({format_size(result.working_set)} working set), synthetic KV (per-channel scales, outlier key channels).\n"
            f"Baselines: memcpy into cold pages {result.memcpy_gbs:.2f} GB/s a core (2 threads {result.memcpy2_gbs:.2f}); "
            f"raw disk read {result.disk_gbs:.2f} GB/s one reader, {result.disk2_gbs:.2f} two ({result.direct}).")
    cols = ("codec", "dtype", "ratio", "encode/core", "decode/core", "decode 1 thr", "decode 2 thr", "2 thr cpu",
            "decode/disk", "read+decode")
    rows = [cols] + [(r.codec, r.dtype, f"{r.ratio:.2f}x", f"{r.encode_cpu_gbs:.2f}", f"{r.decode_cpu_gbs:.2f}",
                      f"{r.decode_gbs:.2f}", f"{r.decode2_gbs:.2f}", f"{r.decode2_parallel:.2f}",
                      f"{r.decode_vs_disk:.2f}", f"{r.read_decode_gbs:.2f}") for r in result.rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    foot = ("All in GB/s of page (decoded) bytes. /core: per CPU second of one thread (what a core of its own\n"
            "does, even on a busy machine); 1 thr, 2 thr: by the clock, one thread and two together; 2 thr cpu: CPU\n"
            "seconds per second meanwhile (near 2: both ran at once, the GIL released). decode/disk: decode/core over\n"
            "one reader's disk rate (over 1: decoding keeps up with the disk). read+decode: reading the encoded page,\n"
            "then decoding it on the same core (identity: the disk rate).")
    return "\n".join([head, "", *lines, "", foot])


@click.command("codecs", short_help="Page codecs: ratio, encode/decode GB/s vs memcpy and raw disk reads.")
@click.option("--dtype", "dtypes", type=click.Choice(list(_NUMPY)), multiple=True,
              help="Page dtype; repeatable  [default: float16 and bfloat16]")
@click.option("--working-set", type=int, default=DEFAULT_WORKING_SET, show_default=True,
              help="Bytes of pages each pass goes over (larger than the caches).")
@click.option("--reps", type=click.IntRange(min=1), default=DEFAULT_REPS, show_default=True, help="Passes; the best counts.")
@click.option("--dir", "directory", type=click.Path(exists=True, file_okay=False, writable=True),
              help="Where the raw disk read's scratch file goes  [default: /var/tmp]")
@click.option("--quick", is_flag=True, help="One pass over 64 MiB.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def command(dtypes: tuple[str, ...], working_set: int, reps: int, directory: str | None, quick: bool, as_json: bool) -> None:
    """Each page codec's ratio and its encode and decode rates (one and two threads) on a
    realistic page, next to a memcpy into cold pages and a raw O_DIRECT disk read measured
    in the same run, and decode rate over disk rate: a compressed page must not make a disk
    read slower."""
    if quick:
        working_set, reps = min(working_set, 64 * MiB), 1
    try:
        result = run_codecs(dtypes=dtypes or DEFAULT_DTYPES, working_set=working_set, reps=reps, directory=directory,
                            progress=lambda line: None if as_json else click.echo(line, err=True))
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(result.as_dict()) if as_json else format_table(result))
