"""`kvtier bench` (also installed as `kvtier-bench`): measurements of kvtier's own parts on this machine."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import signal
import sys

import click

from kvtier_bench import all as all_bench
from kvtier_bench import cluster as cluster_bench
from kvtier_bench import disk as disk_bench
from kvtier_bench import node as node_bench
from kvtier_bench import procs as procs_bench
from kvtier_bench import trace as trace_bench
from kvtier_bench.harness import default_out, format_size, progress_lines, stderr_progress
from kvtier_bench.internals import FsyncPolicy, parse_layout, parse_size
from kvtier_bench.peers import bench as peers_bench
from kvtier_bench.rpc import render_all, run_rpc
from kvtier_bench.tiers import DEFAULT_BYTES, DEFAULT_PAGE_SIZES, DEFAULT_REPS, QUICK_BYTES, format_table, run_tiers


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


@contextlib.contextmanager
def _stop_on_sigterm():
    """While inside, SIGTERM ends the benchmark like Ctrl-C does: through its clean-up, which
    stops the servers it started (each runs in its own session, so a terminal's signals miss them)."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _BenchGroup(click.Group):
    """`kvtier bench`, whose `e2e` and `codec-quality` commands (torch, transformers) are imported
    only when asked for: every other command works whatever state those modules are in."""

    LAZY = {"e2e": ("kvtier_bench.e2e", "command"), "codec-quality": ("kvtier_bench.codec_quality", "command")}
    LAZY["codecs"] = ("kvtier_bench.codecs", "command")  # numpy only, but kept off every other command's start
    LAZY["codec-io"] = ("kvtier_bench.codec_io", "command")

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.LAZY})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.LAZY or name in self.commands:
            return super().get_command(ctx, name)
        module, attribute = self.LAZY[name]
        try:
            return getattr(importlib.import_module(module), attribute)
        except Exception as exc:  # noqa: BLE001 - any failure to load: say so when the command is used
            reason = f"{module} does not load ({type(exc).__name__}: {exc})"

            @click.command(name, help=f"Unavailable: {reason}.", context_settings={"ignore_unknown_options": True})
            @click.argument("args", nargs=-1, type=click.UNPROCESSED)
            def unavailable(args: tuple[str, ...]) -> None:
                raise click.ClickException(reason)

            return unavailable


@click.group(cls=_BenchGroup, context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Benchmarks of kvtier's tiers against the raw operations they are built on."""


@bench.command("tiers", short_help="Host and disk tiers vs np.copyto and raw O_DIRECT.")
@_page_bench_options()
@click.option("--daemon", "through_daemon", is_flag=True,
              help="Also measure host put/get through a `kvtier serve` subprocess and the client's shared-memory "
                   "mapping (borrow/commit, acquire/release), next to np.copyto into the same arena pages; and "
                   "put, get and first fill by several client processes through one daemon, next to the same "
                   "processes copying into a cold private buffer (2MiB and 64KiB pages unless --page-size, 32 "
                   "and 64 per call; --pages is the working set, 1 GiB and 256 MiB by default).")
@click.option("--processes", "processes", type=click.IntRange(min=1, max=64), multiple=True,
              help="Client processes of the multi-process table; repeatable; implies --daemon  [default: 1, 2 and 4]")
def tiers_command(pages: int | None, page_sizes: tuple[int, ...], directory: str | None, as_json: bool, quick: bool,
                  through_daemon: bool, processes: tuple[int, ...]) -> None:
    """Host put/get and disk write/read through a real pool (shared-memory arena, disk tier
    with O_DIRECT and checksums), each next to its baseline in the same run: np.copyto for
    the host tier, raw O_DIRECT pwrite/pread of the same pages for the disk tier. Prints
    pages/s, GB/s and the ratio tier / baseline. With --daemon (or --processes), also put
    and get through a `kvtier serve` subprocess by several client processes at once."""
    through_daemon = through_daemon or bool(processes)
    if through_daemon and pages is not None and pages < max(processes or procs_bench.DEFAULT_PROCESSES):
        raise click.BadParameter("with --daemon, at least as many pages as client processes", param_hint="--pages")
    directory = os.path.abspath(directory) if directory else None
    progress = progress_lines(as_json)
    try:
        with _stop_on_sigterm():
            result = run_tiers(page_sizes or DEFAULT_PAGE_SIZES, pages=pages, quick=quick, directory=directory,
                               through_daemon=through_daemon, progress=progress)
            multi = None
            if through_daemon:
                multi = procs_bench.run_procs(page_sizes or procs_bench.DEFAULT_PAGE_SIZES,
                                              processes=processes or procs_bench.DEFAULT_PROCESSES, pages=pages,
                                              quick=quick, directory=directory, progress=progress)
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result.as_dict() | ({"processes": multi} if multi else {})))
    else:
        click.echo(format_table(result) + (f"\n\n{procs_bench.render_procs(multi)}" if multi else ""))


@bench.command("rpc", short_help="The hot calls over the fast lane and gRPC vs raw echoes.")
@click.option("--iterations", type=click.IntRange(min=10), default=1000, show_default=True,
              help="Timed calls per call and transport (and for each half of the interference figure).")
@click.option("--keys", "keys_per_call", type=click.IntRange(min=1, max=1024), default=64, show_default=True,
              help="Keys (pages) per call.")
@click.option("--processes", "processes", type=click.IntRange(min=1, max=64), multiple=True,
              help="Client processes of the throughput table; repeatable  [default: 1, 2, 4 and 8]")
@click.option("--seconds", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Measured seconds per round of the throughput table.")
@click.option("--clients/--no-clients", "with_clients", default=True, show_default=True,
              help="The multi-client throughput table.")
@click.option("--interference/--no-interference", "with_interference", default=True, show_default=True,
              help="Host-hit latency alone vs while another process loads from disk (disk tier in --dir).")
@click.option("--dir", "directory", type=click.Path(exists=True, file_okay=False, writable=True),
              help="Where the interference daemon's disk tier goes  [default: /var/tmp]")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def rpc_command(iterations: int, keys_per_call: int, processes: tuple[int, ...], seconds: float, with_clients: bool,
                with_interference: bool, directory: str | None, as_json: bool) -> None:
    """The hot calls (Lookup, Acquire+Release, acquire_prefix, Commit+Borrow) over the fast
    lane and over gRPC, next to a raw SOCK_SEQPACKET echo of the same frame sizes and a bare
    gRPC echo, measured in the same run (p50, p99, ratios with their targets); page
    operations per second with 1, 2, 4 and 8 client processes over each transport; and one
    engine's host-hit latency alone vs while another process loads pages from disk."""
    try:
        with _stop_on_sigterm():
            result = run_rpc(iterations, keys_per_call, processes=(processes or (1, 2, 4, 8)) if with_clients else (),
                             seconds=seconds, interference=with_interference,
                             directory=os.path.abspath(directory) if directory else None,
                             progress=progress_lines(as_json))
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(result) if as_json else render_all(result))


@bench.command("disk", short_help="Disk tier bandwidth and prefix loads vs raw O_DIRECT.")
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
            progress=progress_lines(as_json),
        )
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(result.as_dict()) if as_json else disk_bench.format_table(result))


@bench.command("peers", short_help="kvtier vs Redis, Mooncake Store, LMCache and a gRPC store.")
@click.option("--pages", type=click.IntRange(min=1), default=None,
              help="Pages per page size and measurement, the same for every system  [default: 256 MiB worth and "
                   "at least 256 pages; 64 MiB and at least 128 with --quick]")
@click.option("--page-size", "page_sizes", type=_Size(), multiple=True,
              help="Page size; repeatable  [default: 64KiB, 256KiB and 2MiB]")
@click.option("--system", "systems", type=click.Choice(peers_bench.SYSTEM_NAMES), multiple=True,
              help="Only these systems; repeatable  [default: all of them]")
@click.option("--reps", type=click.IntRange(min=1), default=None,
              help=f"Timed repetitions  [default: {peers_bench.DEFAULT_REPS}, {peers_bench.QUICK_REPS} with --quick]")
@click.option("--batch", type=click.IntRange(min=1, max=1024), default=peers_bench.PEERS_BATCH, show_default=True,
              help="Pages per call or round trip, the same for every system.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--quick", is_flag=True, help="Fewer pages and repetitions.")
def peers_command(pages: int | None, page_sizes: tuple[int, ...], systems: tuple[str, ...], reps: int | None,
                  batch: int, as_json: bool, quick: bool) -> None:
    """Put and get of KV pages through kvtier (daemon + shared-memory client, calls over the
    fast lane; again with lane=False; both against np.copyto of the same bytes) next to Redis
    (as LMCache's remote store), Mooncake Store (master + real client + dummy client),
    LMCache's server and a plain gRPC page store, all on loopback, same pages, same run.
    Prints GB/s and kvtier / peer. Install the peers with scripts/setup_bench_peers.sh; a
    peer that cannot run keeps its row with the reason."""
    try:
        with _stop_on_sigterm():
            result = peers_bench.run_peers(page_sizes or peers_bench.PAGE_SIZES, pages=pages, quick=quick, reps=reps,
                                           systems=systems or peers_bench.SYSTEM_NAMES, batch=batch,
                                           progress=progress_lines(as_json))
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(result.as_dict()) if as_json else peers_bench.format_table(result))


@bench.command("trace", short_help="Hit rate vs capacity per policy, on the Mooncake trace and synthetic shapes.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), default=str(trace_bench.DEFAULT_TRACE),
              show_default=True, help="A Mooncake-format trace (JSON lines with hash_ids).")
@click.option("--shape", "shape_names", type=click.Choice([*trace_bench.SHAPES, "all"]), multiple=True,
              help="The requests: mooncake (the --trace file), mooncake-2nd-half (the same, counted on its second "
                   "half by time, the first only warming the cache), or a synthetic shape; repeatable; all for "
                   "every one  [default: mooncake]")
@click.option("--policy", "policies", type=click.Choice(trace_bench.POLICIES), multiple=True,
              help="Eviction policy; repeatable; lru is always replayed (the x lru reference)  [default: every one]")
@click.option("--admission", "admissions", multiple=True,
              help="Disk admission of the host+disk lines, passed to the replay; repeatable; x lru divides by "
                   "lru's with the first one  [default: the store's]")
@click.option("--capacity", "capacities", type=click.IntRange(min=1), multiple=True,
              help="Host capacity in 512-token pages; repeatable  [default: 0.5M to 30M tokens, 3 points with --quick]")
@click.option("--disk-factor", type=click.IntRange(min=0), default=trace_bench.DISK_FACTOR, show_default=True,
              help="The host+disk lines' disk tier, in host capacities; 0 for the one-tier lines alone.")
@click.option("--scale", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Size of the synthetic shapes (1: 100k to 150k blocks each).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic shapes.")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True, help="Replays run at once.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Also write a PNG plot here (with several shapes, one per shape: trace.png -> trace-zipf.png).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables: one object per shape, one a line.")
@click.option("--quick", is_flag=True, help="Three capacity points.")
@click.option("--codec", "codecs", type=click.Choice([*trace_bench.CODEC_NAMES, "all"]), multiple=True,
              help="Print the codec table instead: the Mooncake trace, host 3M tokens (or --capacity), disks of "
                   "30M, 10M and 3M raw-equivalent tokens (or --disk-tokens) holding each codec's measured ratio "
                   "more pages; repeatable; all for every codec (identity, the reference, always runs).")
@click.option("--disk-tokens", type=_Size(), multiple=True, metavar="TOKENS",
              help="The codec table's disks in raw-equivalent tokens ('30M'); repeatable.")
@click.option("--layout", "layout_text", default="", metavar="FIELDS",
              help="The codec table's page layout for measuring ratios, e.g. 'layers=32,kv_heads=8,head_dim=128,"
                   "block_tokens=16,dtype=float16' (the default; fields left out keep it).")
def trace_command(trace_path: str, shape_names: tuple[str, ...], policies: tuple[str, ...], admissions: tuple[str, ...],
                  capacities: tuple[int, ...], disk_factor: int, scale: float, seed: int, workers: int,
                  plot_path: str | None, as_json: bool, quick: bool, codecs: tuple[str, ...],
                  disk_tokens: tuple[int, ...], layout_text: str) -> None:
    """Block hit rate against capacity for each policy, one tier (through the policy alone)
    and host + a 10x disk tier (through the real BlockStore), with its ratio to lru's, the
    disk writes per disk hit and the policy's speed; the infinite-capacity hit rate and
    offline Belady (one tier of the host's pages, and of host + disk) for reference.
    With --codec: what each disk codec buys (hit rate, disk reads per hit) against raw."""
    if codecs:
        try:
            result = trace_bench.run_codecs(
                trace_path, codecs=trace_bench.CODEC_NAMES if "all" in codecs else codecs,
                disk_tokens=disk_tokens or trace_bench.CODEC_DISK_TOKENS,
                host_pages=capacities[0] if capacities else trace_bench.CODEC_HOST_PAGES,
                policy=policies[0] if policies else trace_bench.REFERENCE, layout=parse_layout(layout_text),
                workers=workers, progress=progress_lines(as_json))
        except (ValueError, OSError) as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(json.dumps(result.as_dict()) if as_json else trace_bench.format_codec_table(result))
        return
    names = trace_bench.SHAPES if "all" in shape_names else shape_names or (trace_bench.MOONCAKE,)
    try:
        results = trace_bench.run_shapes(names, trace=trace_path, capacities=capacities or None, quick=quick,
                                         policies=policies or trace_bench.POLICIES, admissions=admissions,
                                         disk_factor=disk_factor, seed=seed, scale=scale, workers=workers,
                                         progress=progress_lines(as_json))
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    for result in results:
        if plot_path:
            trace_bench.plot(result, trace_bench.plot_path(plot_path, result.shape, len(results) > 1))
        click.echo(json.dumps(result.as_dict()) if as_json else trace_bench.format_table(result) + "\n")


@bench.command("cluster", short_help="The cluster tier vs redis-py, and a two-node trace replay.")
@click.option("--pages", type=click.IntRange(min=1), default=None,
              help=f"Pages per page size and measurement  [default: {format_size(cluster_bench.DEFAULT_BYTES)} worth, "
                   f"{format_size(cluster_bench.QUICK_BYTES)} with --quick, at least {cluster_bench.MIN_PAGES}]")
@click.option("--page-size", "page_sizes", type=_Size(), multiple=True,
              help="Page size of the put/get part; repeatable  [default: 256KiB and 2MiB]")
@click.option("--reps", type=click.IntRange(min=1), default=None,
              help=f"Timed repetitions  [default: {cluster_bench.DEFAULT_REPS}, "
                   f"{cluster_bench.QUICK_REPS} with --quick]")
@click.option("--batch", type=click.IntRange(min=1, max=1024), default=cluster_bench.BATCH, show_default=True,
              help="Pages per pipeline, the same for the tier and redis-py.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), default=str(trace_bench.DEFAULT_TRACE),
              show_default=True, help="A Mooncake-format trace (JSON lines with hash_ids).")
@click.option("--requests", type=click.IntRange(min=cluster_bench.NODES), default=cluster_bench.TRACE_REQUESTS,
              show_default=True, help="Replay the trace's first REQUESTS requests.")
@click.option("--full-trace", is_flag=True, help="Replay every request of the trace (12,031; minutes).")
@click.option("--host-pages", type=click.IntRange(min=2 * cluster_bench.LEASE_PAGES), default=cluster_bench.HOST_PAGES,
              show_default=True, help="Host tier of each daemon in the replay, in pages.")
@click.option("--disk-pages", type=click.IntRange(min=0), default=cluster_bench.DISK_PAGES, show_default=True,
              help="Disk tier of each daemon in the replay, in pages.")
@click.option("--part", "parts", type=click.Choice(["pages", "trace"]), multiple=True,
              help="Only this part; repeatable  [default: both]")
@click.option("--dir", "directory", type=click.Path(exists=True, file_okay=False, writable=True),
              help="Where the cluster's node directories and the daemons' disk tiers go  [default: /var/tmp]")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option("--quick", is_flag=True, help="Fewer pages and repetitions in the put/get part.")
def cluster_command(pages: int | None, page_sizes: tuple[int, ...], reps: int | None, batch: int, trace_path: str,
                    requests: int, full_trace: bool, host_pages: int, disk_pages: int, parts: tuple[str, ...],
                    directory: str | None, as_json: bool, quick: bool) -> None:
    """The cluster tier on a loopback Redis Cluster of real redis-server processes. Put/get of
    pages through the tier (ClusterTier.write/read: header, checksum, copy into a host buffer)
    next to redis-py's pipelined SET/GET of the same pages on the same cluster, same run (ratio
    tier / redis-py, target >= 0.8). Then the Mooncake trace replayed round-robin over two
    `kvtier serve` daemons with small host and disk tiers, without and with `--cluster`: block
    hit rate in total, per node and per tier. Needs redis-server (scripts/setup_redis.sh)."""
    missing = cluster_bench.server_missing()
    if missing:
        raise click.ClickException(missing)
    parts = parts or ("pages", "trace")
    try:
        with _stop_on_sigterm():
            result = cluster_bench.run_cluster(
                (page_sizes or cluster_bench.PAGE_SIZES) if "pages" in parts else (), pages=pages, reps=reps,
                batch=batch, quick=quick, trace=trace_path if "trace" in parts else None,
                requests=None if full_trace else requests, host_pages=host_pages, disk_pages=disk_pages,
                directory=os.path.abspath(directory) if directory else None, progress=progress_lines(as_json))
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(result.as_dict()) if as_json else cluster_bench.format_table(result))


@bench.command("node", short_help="One node-wide daemon vs one daemon per engine, same memory (Mooncake trace).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), default=str(trace_bench.DEFAULT_TRACE),
              show_default=True, help="A Mooncake-format trace (JSON lines with timestamp and hash_ids).")
@click.option("--requests", type=click.IntRange(min=node_bench.ENGINES), default=None,
              help="Replay only the first REQUESTS requests by time  [default: all of them]")
@click.option("--fraction", "fractions", type=click.FloatRange(min=0, max=1, min_open=True), multiple=True,
              help="Host pages of all daemons together, as a share of the trace's distinct blocks; repeatable  "
                   "[default: 0.1, 0.25 and 0.5]")
@click.option("--disk-factor", type=click.IntRange(min=0), default=0, show_default=True,
              help="Each daemon also has a disk tier of this many times its host pages.")
@click.option("--setup", "setups", type=click.Choice(node_bench.SETUP_NAMES), multiple=True,
              help="Only these setups; repeatable  [default: all]")
@click.option("--policy", type=click.Choice(trace_bench.POLICIES), default=None,
              help="The daemons' eviction policy  [default: the daemon's default]")
@click.option("--save", "save", type=click.Path(dir_okay=False), default=None,
              help="Also write SAVE.json, SAVE.md and SAVE.png (e.g. benchmarks/results/<date>/node).")
@click.option("--dir", "directory", type=click.Path(exists=True, file_okay=False, writable=True),
              help="Where the daemons' cache directories go  [default: /var/tmp]")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def node_command(trace_path: str, requests: int | None, fractions: tuple[float, ...], disk_factor: int,
                 setups: tuple[str, ...], policy: str | None, save: str | None, directory: str | None,
                 as_json: bool) -> None:
    """Four engine processes on one node, the Mooncake trace's requests in time order, with the
    same total memory: one shared `kvtier serve` for all four (one namespace, round-robin
    routing) against four private daemons, one per engine (round-robin, and behind a
    prefix-affinity router). Block hit rate, its ratio to the private daemons', prefill
    tokens saved and wall time at each capacity."""
    from kvtier_bench import node_report

    try:
        with _stop_on_sigterm():
            result = node_bench.run_node(trace_path, requests=requests, fractions=fractions or node_bench.FRACTIONS,
                                         disk_factor=disk_factor, setups=setups or node_bench.SETUP_NAMES,
                                         policy=policy, directory=os.path.abspath(directory) if directory else None,
                                         progress=progress_lines(as_json))
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if save:
        node_report.save(result, save)
    click.echo(json.dumps(result.as_dict()) if as_json else node_report.format_table(result))


@bench.command("all", short_help="Every benchmark in one run, with results and plots.")
@click.option("--quick", is_flag=True, help="Every section smaller: under 10 minutes on 2 cores.")
@click.option("--out", "out", type=click.Path(file_okay=False), default=None,
              help="Output directory  [default: benchmarks/results/<YYYY-MM-DD>]")
@click.option("--section", "sections", type=click.Choice(all_bench.SECTIONS), multiple=True,
              help="Only these sections; repeatable  [default: all]")
@click.option("--skip", type=click.Choice(all_bench.SECTIONS), multiple=True, help="Leave out a section; repeatable.")
@click.option("--dir", "directory", type=click.Path(exists=True, file_okay=False, writable=True),
              help="Where the disk tiers and raw files go  [default: /var/tmp]")
def all_command(quick: bool, out: str | None, sections: tuple[str, ...], skip: tuple[str, ...],
                directory: str | None) -> None:
    """Every benchmark (tiers, rpc, peers, trace, cluster, node, e2e) in one run: results.json, results.md and
    PNG plots in one directory, the machine described, each figure against a baseline from the
    same run. Progress goes to stderr; a section that fails records its error and the rest runs."""
    chosen = [s for s in (sections or all_bench.SECTIONS) if s not in skip]
    settings = all_bench.Settings.for_mode(quick)
    if directory:
        settings = dataclasses.replace(settings, directory=os.path.abspath(directory))
    command = "kvtier bench all" + (" --quick" if quick else "") + "".join(f" --section {s}" for s in sections) \
        + "".join(f" --skip {s}" for s in skip)
    with _stop_on_sigterm():
        document = all_bench.run_all(out, quick=quick, sections=chosen, settings=settings, command=command,
                                     progress=stderr_progress())
    failed = [name for name, entry in document["sections"].items() if not entry["ok"]]
    click.echo(f"results in {out or default_out()}: "
               + ", ".join(f"{n} {'ok' if e['ok'] else 'FAILED'}" for n, e in document["sections"].items()))
    for t in document["targets"]:
        measured = "-" if t["measured"] is None else f"{t['measured']:.2f}"
        click.echo(f"  {t['section']:<6} {t['what']:<40} {t['target']:<28} {measured:>7}  "
                   f"{ {True: 'met', False: 'NOT MET', None: '-'}[t['met']] }")
    if failed:
        raise click.ClickException(f"section(s) failed: {', '.join(failed)} (errors in results.json)")

