"""The `kvtier` command line."""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from importlib import metadata

import click
from kvtier_client.errors import KVTierError, Unavailable
from kvtier_client.events import EventStream, KVEvent
from kvtier_client.proto.v1 import kvtier_pb2 as pb

from kvtier.admin import (
    _connection_options,
    _token_option,
    connect,
    console,
    emit,
    health_check,
    stats,
    table,
)
from kvtier.demo import demo
from kvtier.keeper_cli import keeper
from kvtier.policy import POLICIES
from kvtier.replay.codec import CODECS, DEFAULT_LAYOUT, IDENTITY, codec_ratio, describe, parse_layout
from kvtier.replay.hints import DEFAULT_TTL_FACTOR, HintRule, replay_with_hints
from kvtier.replay.mooncake import halfway, read_timed_trace
from kvtier.server.cli import serve
from kvtier.steer_cli import cache


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cuda_versions() -> list[tuple[str, str]]:
    """CuPy's version and the CUDA runtime and driver it sees; CuPy is imported only here,
    and nothing about it (absent, broken, no GPU) is an error."""
    try:
        import cupy  # noqa: PLC0415 - lazily: only --version asks, and most hosts have no GPU
    except Exception as exc:  # noqa: BLE001 - ImportError, or a CuPy that cannot load its CUDA libraries
        reason = "not installed" if isinstance(exc, ModuleNotFoundError) else f"does not load ({type(exc).__name__})"
        return [("CuPy", reason), ("CUDA", "not available")]
    rows = [("CuPy", getattr(cupy, "__version__", "?"))]
    try:
        runtime = cupy.cuda.runtime.runtimeGetVersion()
        cuda = f"runtime {runtime // 1000}.{runtime % 1000 // 10}"
        try:
            driver = cupy.cuda.runtime.driverGetVersion()
            cuda += f", driver {driver // 1000}.{driver % 1000 // 10}"
            cuda += f", {cupy.cuda.runtime.getDeviceCount()} GPU(s)"
        except Exception:  # noqa: BLE001 - no driver or no device: the runtime version still says something
            cuda += ", no GPU"
    except Exception as exc:  # noqa: BLE001
        cuda = f"not available ({type(exc).__name__})"
    rows.append(("CUDA", cuda))
    return rows


def version_rows() -> list[tuple[str, str]]:
    """(component, version) for `kvtier --version`."""
    return [
        ("kvtier", _version("kvtier")),
        ("kvtier-client", _version("kvtier-client")),
        ("grpcio", _version("grpcio")),
        ("protobuf", _version("protobuf")),
        ("Python", f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"),
        *_cuda_versions(),
    ]


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    rows = version_rows()
    if console().is_terminal:
        emit(table(["component", "version"], rows, left=2, header=False, plain=False))
    else:
        width = max(len(name) for name, _ in rows)
        click.echo("\n".join(f"{name:<{width}}  {version}" for name, version in rows))
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]},
             epilog="""\b
Examples:
  kvtier serve --host-size 8GiB --disk-size 100GiB --cache-dir /var/cache/kvtier
  kvtier stats --watch                    # every 2s; --watch 500ms, --count N
  kvtier COMMAND --help                   # each command's options and examples
Shell completion (bash; zsh and fish likewise, docs/cli.md):
  eval "$(_KVTIER_COMPLETE=bash_source kvtier)"
""")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the versions of kvtier, its client, grpcio, protobuf, Python and CUDA/CuPy, and exit.")
def main() -> None:
    """kvtier: a KV-cache tiering sidecar for LLM inference."""


main.add_command(serve)
main.add_command(stats)
main.add_command(cache)
main.add_command(health_check)
main.add_command(keeper)
# demo's own module says what it does; the listing's one line and the example are the CLI's.
demo.short_help = demo.short_help or "Start a throwaway daemon and walk one prompt through the cache."
demo.epilog = demo.epilog or "\b\nExample:\n  kvtier demo --host-size 16Mi --disk-size 64MiB"
main.add_command(demo)


@main.command("replay", short_help="Hit rates of a Mooncake trace through the cache's policies.",
              epilog="""\b
Examples:
  kvtier replay mooncake_trace.jsonl --host-pages 5859 --disk-pages 58590 --policy frecency
  kvtier replay mooncake_trace.jsonl --host-pages 5859 --disk-pages 58594 --codec fp8
  kvtier replay mooncake_trace.jsonl --second-half --json
  kvtier replay mooncake_trace.jsonl --policy frecency --hint-rule continue-ttl""")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False), metavar="TRACE")
@click.option("--host-pages", type=click.IntRange(min=1), default=5859, show_default=True, metavar="PAGES",
              help="Host tier capacity in pages (512-token blocks).")
@click.option("--disk-pages", type=click.IntRange(min=0), default=0, show_default=True, metavar="PAGES",
              help="Disk tier capacity in raw pages (the bytes of that many unencoded pages); 0 for no disk tier.")
@click.option("--device-pages", type=click.IntRange(min=0), default=0, show_default=True, metavar="PAGES",
              help="Device (GPU) tier capacity in pages; 0 for none. Cached blocks are then acquired into it.")
@click.option("--policy", default="lru", show_default=True, metavar="NAME",
              help=f"Eviction policy of every tier: {', '.join(POLICIES.builtin)}, or MODULE:CLASS of your own.")
@click.option("--codec", default=IDENTITY, show_default=True, metavar="NAME",
              help=f"Codec the disk tier writes with ({', '.join(CODECS.builtin)}, or MODULE:CLASS): the disk "
                   "holds --disk-pages x the codec's ratio, measured by encoding synthetic KV pages of --layout "
                   "(the host tier never encodes).")
@click.option("--disk-ratio", type=click.FloatRange(min=0, min_open=True), default=None, metavar="X",
              help="Scale the disk by X instead of a measured ratio (one measured on real KV elsewhere).")
@click.option("--layout", "layout_text", default=describe(DEFAULT_LAYOUT), show_default=True, metavar="FIELDS",
              help="The page layout the codec's ratio is measured on (fields left out keep the default's).")
@click.option("--second-half", is_flag=True,
              help="Count only the requests of the trace's second half by time (the first half warms the cache).")
@click.option("--hint-rule", type=click.Choice([r.value for r in HintRule]), default=HintRule.NONE.value,
              show_default=True, help="An online client hint rule run after each request (kvtier/replay/hints.py): "
                                      "continue-ttl retains a conversation's next turn high for a TTL.")
@click.option("--hint-ttl-factor", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_TTL_FACTOR,
              show_default=True, metavar="X", help="continue-ttl's TTL: X times the median gap between turns so far.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def replay_command(trace: str, host_pages: int, disk_pages: int, device_pages: int, policy: str, codec: str,
                   disk_ratio: float | None, layout_text: str, second_half: bool, hint_rule: str,
                   hint_ttl_factor: float, as_json: bool) -> None:
    """Replay a Mooncake-format TRACE through the block index and policies (no bytes moved)
    and report the block hit rate, overall and per tier, the pages written to disk and
    how fast the policy's own bookkeeping ran. With --codec or --disk-ratio the disk tier
    holds more pages in the same bytes."""
    try:
        ratio = codec_ratio(codec, disk_ratio, parse_layout(layout_text))
        timed = list(read_timed_trace(trace))
        start = halfway([t for t, _ in timed]) if second_half else 0
        result, hints = replay_with_hints(timed, rule=hint_rule, ttl_factor=hint_ttl_factor, host_pages=host_pages,
                                          disk_pages=ratio.pages(disk_pages), policy=policy,
                                          device_pages=device_pages, measure_from=start)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    data = result.as_dict()
    if as_json:
        click.echo(json.dumps({**data, "disk_codec": {**ratio.as_dict(), "raw_disk_pages": disk_pages},
                               **({"hints": hints.as_dict()} if hints else {})}))
        return
    rows = [
        ("trace", f"{os.path.basename(trace)}: {result.requests} requests, {result.blocks} blocks"
                  + (f" (second half, from request {start})" if second_half else "")),
        ("tiers", f"device {device_pages}, host {host_pages}, disk {result.disk_pages} pages, policy {policy}"),
        *((("disk codec", (f"{ratio.codec}, ratio {ratio.ratio:.3f}: {disk_pages} raw pages' bytes hold "
                           f"{result.disk_pages} ({ratio.source})")),) if disk_pages and ratio.ratio != 1.0 else ()),
        ("block hit rate", f"{data['block_hit_rate']:.4f}"),
        *((f"  from {tier}", f"{rate:.4f}") for tier, rate in data["tier_hit_rates"].items()),
        *((("disk writes", f"{result.disk_writes} pages, {result.disk_writes_per_hit:.2f} per disk hit"),) if disk_pages else ()),
        *((("disk reads", f"{result.disk_hit_blocks} pages, {_per_hit(result):.3f} per hit"),) if disk_pages else ()),
        ("policy speed", f"{result.policy_blocks_per_second:,.0f} blocks/s ({result.policy_seconds:.2f} s in the policies)"),
        *((("hints", (f"{hints.rule}: {hints.retains} of {hints.continuations} continuations retained high, "
                      f"{hints.retained_blocks} blocks, last TTL {hints.ttl_factor:g} x {hints.median_gap_seconds:.0f} s")),)
          if hints else ()),
    ]
    if console().is_terminal:
        emit(table(["", ""], rows, left=2, header=False, plain=False, title="replay"))
    else:  # label, one space, value: "block hit rate 0.2000" (scripts grep these lines)
        width = max(len(label) for label, _ in rows)
        click.echo("\n".join(f"{label:<{width}} {value}" for label, value in rows))


def _per_hit(result) -> float:
    """Disk reads (blocks served from disk) per block hit."""
    return result.disk_hit_blocks / result.hit_blocks if result.hit_blocks else 0.0


def event_json(event: KVEvent) -> dict:
    return {"ts": event.ts, "kind": event.kind.name.lower(), "namespace": event.namespace,
            "tier": event.tier.label if event.tier is not None else None, "keys": [k.hex() for k in event.keys],
            "parent": event.parent.hex() if event.parent else None, "token_ids": list(event.token_ids),
            "block_size": event.block_size}


def event_line(event: KVEvent) -> str:
    """One event in a line: when, what, where, whose, which blocks (keys cut to 12 hex digits)."""
    when = time.strftime("%H:%M:%S", time.localtime(event.ts)) + f".{int(event.ts * 1000) % 1000:03d}"
    tier = event.tier.label if event.tier is not None else "all"
    line = f"{when} {event.kind.name.lower():<7} {tier:<7} {event.namespace}"
    if event.keys:
        span = event.keys[0].hex()[:12] + (f"..{event.keys[-1].hex()[:12]}" if len(event.keys) > 1 else "")
        line += f"  {len(event.keys)} block{'s' if len(event.keys) > 1 else ''} {span}"
    if event.parent:
        line += f"  after {event.parent.hex()[:12]}"
    if event.token_ids:
        line += f"  {len(event.token_ids)} token ids"
    return line


@main.command("events", short_help="Follow the daemon's KV events (blocks stored, removed).",
              epilog="""\b
Examples:
  kvtier events --socket /tmp/kvtier/kvtier.sock
  kvtier events --namespace my-model/tenant-a --json | jq .kind""")
@_connection_options
@_token_option
@click.option("--namespace", "namespaces", multiple=True, metavar="NAME",
              help="Only this namespace (repeatable). Default: every namespace the token grants.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event (keys in hex).")
def events_command(socket: str | None, target: str | None, tls_ca: str | None, tls_cert: str | None,
                   tls_key: str | None, token: str | None, namespaces: tuple[str, ...], as_json: bool) -> None:
    """Print the daemon's KV events as they happen: blocks stored in, and removed from, each
    tier (the daemon must run with --events). Ctrl-C stops."""
    conn = connect(socket, target, tls_ca, tls_cert, tls_key, token)
    address = conn.target
    try:
        stream = EventStream(conn.stub.WatchEvents(pb.WatchEventsRequest(namespaces=namespaces), metadata=conn.metadata))
        click.echo(f"watching KV events of {', '.join(namespaces) or 'every namespace the token grants'} at {address}; "
                   "Ctrl-C stops", err=True)
        missed = 0
        for event in stream:
            if stream.missed > missed:
                click.echo(f"missed {stream.missed - missed} block events (this watcher fell behind)", err=True)
                missed = stream.missed
            click.echo(json.dumps(event_json(event)) if as_json else event_line(event))
    except Unavailable:
        raise click.ClickException(f"no kvtier daemon answers at {address}; start one with `kvtier serve --events ...` "
                                   "or pass --socket/--target") from None
    except KVTierError as exc:
        raise click.ClickException(f"{exc.code}: {exc}") from None
    except KeyboardInterrupt:
        pass
    finally:
        conn.close()


#: How to install the benchmarks, as scripts/setup.sh does (from a kvtier checkout).
BENCH_INSTALL = "pip install -e ./benchmarks (from a kvtier checkout; scripts/setup.sh does it)"


def _bench_group() -> click.Command | None:
    """The benchmarks' command group, or None where kvtier-bench is not installed."""
    try:
        from kvtier_bench.cli import bench
    except ModuleNotFoundError as exc:
        if exc.name not in ("kvtier_bench", "kvtier_bench.cli"):
            raise  # installed, but something it needs is missing: say which
        return None
    return bench


class _LazyBench(click.Command):
    """`kvtier bench`: the benchmarks live in their own distribution (kvtier-bench, benchmarks/)
    and are imported only when this command runs or shows its help, never by `kvtier serve`.
    Without them `--help` still answers (and says how to install them); anything else exits 2
    with that one line."""

    def __init__(self) -> None:
        super().__init__("bench", short_help="Benchmarks (the kvtier-bench distribution).",
                         help="Benchmarks of kvtier's tiers against the raw operations they are built on "
                              f"(`kvtier bench --help` lists them; needs kvtier-bench: {BENCH_INSTALL}).",
                         epilog="\b\nExamples:\n  kvtier bench tiers --quick\n  kvtier bench all --quick")

    def make_context(self, info_name, args, parent=None, **extra):
        bench = _bench_group()
        if bench is not None:
            return bench.make_context(info_name, args, parent=parent, **extra)
        help_names = (parent.help_option_names if parent is not None else None) or ["--help"]
        if not args or any(arg in help_names for arg in args):
            self.help = (f"The benchmarks of kvtier's tiers against the raw operations they are built on. They are "
                         f"not installed here: {BENCH_INSTALL}; then `kvtier bench --help` lists them.")
            return super().make_context(info_name, ["--help"], parent=parent, **extra)
        click.echo(f"kvtier bench: the benchmarks are not installed; {BENCH_INSTALL}", err=True)
        sys.exit(2)


main.add_command(_LazyBench())

if __name__ == "__main__":
    sys.exit(main())
