"""The `kvtier` command line."""
from __future__ import annotations

import importlib
import json
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


#: Commands imported only when they run or are listed (`kvtier --help`): `kvtier stats` and
#: the other admin commands load the client side only, never the daemon's core, policies or
#: mechanism (tests/server/test_cli_output.py holds `kvtier stats` to that).
LAZY_COMMANDS = {
    "serve": "kvtier.server.cli:serve",
    "cache": "kvtier.steer_cli:cache",
    "keeper": "kvtier.keeper_cli:keeper",
    "demo": "kvtier.demo:demo",
    "replay": "kvtier.replay_cli:replay_command",
}


class _Commands(click.Group):
    """The `kvtier` group: its own commands, and LAZY_COMMANDS imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in LAZY_COMMANDS and name not in self.commands:
            module, attr = LAZY_COMMANDS[name].split(":")
            self.add_command(getattr(importlib.import_module(module), attr), name)
        return super().get_command(ctx, name)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]},
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


main.add_command(stats)
main.add_command(health_check)


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
