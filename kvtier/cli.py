"""The `kvtier` command line."""
from __future__ import annotations

import json
import os
import sys

import click

from kvtier.admin import health_check, stats
from kvtier.demo import demo
from kvtier.policy import PolicyName
from kvtier.replay.mooncake import read_trace, replay
from kvtier.server.cli import serve


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvtier")
def main() -> None:
    """kvtier: a KV-cache tiering sidecar for LLM inference."""


main.add_command(serve)
main.add_command(stats)
main.add_command(health_check)
main.add_command(demo)


@main.command("replay")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@click.option("--host-pages", type=click.IntRange(min=1), default=5859, show_default=True, help="Host tier capacity in pages (512-token blocks).")
@click.option("--disk-pages", type=click.IntRange(min=0), default=0, show_default=True, help="Disk tier capacity in pages; 0 for no disk tier.")
@click.option("--device-pages", type=click.IntRange(min=0), default=0, show_default=True,
              help="Device (GPU) tier capacity in pages; 0 for none. Cached blocks are then acquired into it.")
@click.option("--policy", type=click.Choice([p.value for p in PolicyName]), default=PolicyName.LRU.value, show_default=True,
              help="Eviction policy of every tier.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def replay_command(trace: str, host_pages: int, disk_pages: int, device_pages: int, policy: str, as_json: bool) -> None:
    """Replay a Mooncake-format TRACE through the block index and policies (no bytes moved)
    and report the block hit rate, overall and per tier."""
    try:
        result = replay(read_trace(trace), host_pages=host_pages, disk_pages=disk_pages, policy=PolicyName(policy),
                        device_pages=device_pages)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    data = result.as_dict()
    if as_json:
        click.echo(json.dumps(data))
        return
    click.echo(f"trace          {os.path.basename(trace)}: {result.requests} requests, {result.blocks} blocks")
    click.echo(f"tiers          device {device_pages}, host {host_pages}, disk {disk_pages} pages, policy {policy}")
    click.echo(f"block hit rate {data['block_hit_rate']:.4f}")
    for tier, rate in data["tier_hit_rates"].items():
        click.echo(f"  from {tier:<8} {rate:.4f}")


class _LazyBench(click.Command):
    """`kvtier bench`: the benchmarks live in their own distribution (kvtier-bench, benchmarks/)
    and are imported only when this command runs or shows its help, never by `kvtier serve`."""

    def __init__(self) -> None:
        super().__init__("bench", short_help="Benchmarks (the kvtier-bench distribution).")

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            from kvtier_bench.cli import bench
        except ModuleNotFoundError as exc:
            if exc.name not in ("kvtier_bench", "kvtier_bench.cli"):
                raise
            raise click.ClickException("`kvtier bench` needs the benchmarks: install kvtier-bench "
                                       "(pip install -e ./benchmarks)") from None
        return bench.make_context(info_name, args, parent=parent, **extra)


main.add_command(_LazyBench())

if __name__ == "__main__":
    sys.exit(main())
