"""`kvtier replay`: a Mooncake trace through the block index and policies, no bytes moved
(kvtier.replay). Its own module so that the other commands never import the policies."""
from __future__ import annotations

import json
import os

import click

from kvtier.admin import console, emit, table
from kvtier.policy import POLICIES
from kvtier.replay.codec import CODECS, DEFAULT_LAYOUT, IDENTITY, codec_ratio, describe, parse_layout
from kvtier.replay.hints import DEFAULT_TTL_FACTOR, HintRule, replay_with_hints
from kvtier.replay.mooncake import halfway, read_timed_trace


@click.command("replay", short_help="Hit rates of a Mooncake trace through the cache's policies.",
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
