"""`kvtier bench`: measurements of kvtier's own parts on this machine."""
from __future__ import annotations

import json
import os

import click

from kvtier.bench.tiers import (
    DEFAULT_BYTES,
    DEFAULT_PAGE_SIZES,
    DEFAULT_REPS,
    QUICK_BYTES,
    format_size,
    format_table,
    run_tiers,
)
from kvtier.bench.rpc import render_rpc, run_rpc_bench
from kvtier.bench import disk as disk_bench
from kvtier.mechanism.disk import FsyncPolicy
from kvtier.units import parse_size


class _Size(click.ParamType):
    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def _page_bench_options(pages_note: str = ""):
    """The options every page-moving benchmark takes: sizes, counts, where, how."""

    def decorate(f):
        for option in reversed((
            click.option("--pages", type=click.IntRange(min=1), default=None,
                         help=f"Pages per page size and measurement  [default: {format_size(DEFAULT_BYTES)} worth, "
                              f"{format_size(QUICK_BYTES)} with --quick{pages_note}]"),
            click.option("--page-size", "page_sizes", type=_Size(), multiple=True,
                         help="Page size, e.g. 256KiB or 2MiB; repeatable  [default: 256KiB and 2MiB]"),
            click.option("--dir", "directory", type=click.Path(exists=True, file_okay=False, writable=True),
                         help="Where the disk tier and the raw baseline file go (a temporary subdirectory, removed "
                              "afterwards)  [default: /var/tmp, a real disk, not tmpfs]"),
            click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables."),
            click.option("--quick", is_flag=True,
                         help=f"One repetition instead of {DEFAULT_REPS}, and fewer pages unless --pages is given."),
        )):
            f = option(f)
        return f

    return decorate


def _progress(as_json: bool):
    """Progress lines on stderr, silent when the output is JSON."""
    return (lambda message: None) if as_json else (lambda message: click.echo(f"... {message}", err=True))


@click.group()
def bench() -> None:
    """Benchmarks of kvtier's tiers against the raw operations they are built on."""


@bench.command("tiers")
@_page_bench_options()
def tiers_command(pages: int | None, page_sizes: tuple[int, ...], directory: str | None, as_json: bool, quick: bool) -> None:
    """Host put/get and disk write/read through a real pool (shared-memory arena, disk tier
    with O_DIRECT and checksums), each next to its baseline in the same run: np.copyto for
    the host tier, raw O_DIRECT pwrite/pread of the same pages for the disk tier. Prints
    pages/s, GB/s and the ratio tier / baseline."""
    try:
        result = run_tiers(
            page_sizes or DEFAULT_PAGE_SIZES,
            pages=pages,
            quick=quick,
            directory=os.path.abspath(directory) if directory else None,
            progress=_progress(as_json),
        )
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result.as_dict()))
    else:
        click.echo(format_table(result))


@bench.command("rpc")
@click.option("--iterations", type=click.IntRange(min=10), default=1000, show_default=True, help="Timed calls per measurement.")
@click.option("--keys", "keys_per_call", type=click.IntRange(min=1, max=1024), default=64, show_default=True, help="Keys (pages) per batched call.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def rpc_command(iterations: int, keys_per_call: int, as_json: bool) -> None:
    """Control-plane latency over the Unix socket: a batched Lookup and Acquire+Release
    against a bare gRPC echo server measured in the same run (median, p99, ratio), and
    pages per second through batched Borrow/Commit/Acquire/Release."""
    result = run_rpc_bench(iterations, keys_per_call)
    click.echo(json.dumps(result) if as_json else render_rpc(result))


@bench.command("disk")
@_page_bench_options(f", at least one {disk_bench.PREFIX_TOKENS:,}-token prefix")
@click.option("--io-depth", type=click.IntRange(min=1), default=disk_bench.DEFAULT_IO_DEPTH, show_default=True,
              help="Disk reads and writes in flight: the pool's io_depth and the baseline's thread count.")
@click.option("--fsync", type=click.Choice([p.value for p in FsyncPolicy]), default=FsyncPolicy.BATCH.value,
              show_default=True, help="The disk tier's fsync policy; the baseline flushes the same way.")
def disk_command(pages: int | None, page_sizes: tuple[int, ...], io_depth: int, fsync: str, directory: str | None,
                 as_json: bool, quick: bool) -> None:
    """Disk tier bandwidth and prefix load time through a real pool (shared-memory arena, disk
    tier with O_DIRECT and checksums), each next to raw O_DIRECT pwrite/pread of the same
    pages at the same parallelism in the same run: write-back demotion, prefetch +
    wait_loaded, WAIT_ALL acquires, and a 4,096-token prefix prefetched or acquired cold.
    Prints pages/s, GB/s, ms and the ratio tier / baseline."""
    try:
        result = disk_bench.run_disk(
            page_sizes or DEFAULT_PAGE_SIZES,
            pages=pages,
            io_depth=io_depth,
            fsync=fsync,
            quick=quick,
            directory=os.path.abspath(directory) if directory else None,
            progress=_progress(as_json),
        )
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(result.as_dict()) if as_json else disk_bench.format_table(result))
