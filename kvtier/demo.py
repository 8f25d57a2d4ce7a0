"""`kvtier demo`: start a throwaway daemon and walk one prompt through the cache.

It shows the whole protocol from an engine's side with nothing to configure: a daemon on
a temporary socket and cache directory (host and disk tiers, no GPU), one client doing
register -> block keys -> lookup (miss) -> borrow, write KV, commit -> lookup (hit) ->
acquire and compare bytes -> release -> stats, and a clean SIGTERM shutdown that must
exit 0. Any step that does not behave makes the command fail.
"""
from __future__ import annotations

import tempfile
import uuid

import click
import numpy as np
from kvtier_client import Backoff, KVTierClient, PageLayout, Stats

from kvtier.admin import Size
from kvtier.child import ChildDaemon, ChildDaemonError

DEMO_LAYOUT = PageLayout(layers=4, kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")
DEMO_PROMPT = "You are a helpful assistant. Summarise the following document in three short sentences, please."
START_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0


def _short(key: bytes) -> str:
    return key.hex()[:12]


def round_trip(client: KVTierClient, prompt: str, echo=click.echo) -> None:
    """The engine's side of one cache miss and one cache hit, narrated step by step."""
    step = iter(range(1, 100))

    def say(name: str, text: str) -> None:
        echo(f"{next(step):>2}. {name:<11} {text}")

    layout = DEMO_LAYOUT
    pool = client.register("demo/tiny-model", layout)
    say("register", f"namespace demo/tiny-model, session {pool.session_id[:8]}, pool {pool.pool_id}")
    echo(
        f"{'':15}layout {layout.layers} layers x {layout.kv_heads} kv heads x {layout.head_dim} dim, "
        f"{layout.block_tokens} tokens/page, {layout.dtype}: {pool.page_bytes} bytes/page"
    )
    echo(f"{'':15}session attached over {pool.handoff_socket}: this namespace's host arena mapped "
         f"({pool.host_arena_bytes // pool.slot_bytes} slots, handed over as a file descriptor, no path)")

    token_ids = list(prompt.encode())  # a byte-level "tokenizer": one token per UTF-8 byte
    keys = client.block_keys(token_ids)
    if not keys:
        raise click.ClickException(f"the prompt needs at least {layout.block_tokens} tokens (bytes) for one block")
    say("block keys", f"{len(token_ids)} tokens -> {len(keys)} full blocks ({pool.algorithm}): "
        + ", ".join(_short(k) for k in keys[:3]) + (", ..." if len(keys) > 3 else ""))

    first = client.lookup(keys)
    say("lookup", f"{first.hit_blocks} of {len(keys)} blocks cached: {'hit' if first.hit_blocks else 'miss'}")
    if first.hit_blocks:
        raise click.ClickException("a fresh daemon reported cached blocks: expected a miss")

    kv = np.random.default_rng(0).standard_normal((len(keys), *layout.shape)).astype(np.float16)
    with client.borrow(len(keys)) as lease:
        for page, values in zip(lease.pages, kv):
            page[...] = values  # the "engine" writes its KV straight into the shared pages
        say("borrow", f"lease {lease.lease_id}: {lease.count} host pages (slots {list(lease.slots)}); wrote KV in place")
        result = lease.commit(keys)
    say("commit", f"{result.committed} pages published under their block keys, {len(result.duplicates)} duplicates")

    second = client.lookup(keys)
    tiers = ", ".join(t.label for t in second.tiers)
    outcome = "hit" if second.hit_blocks == len(keys) else "MISS"
    say("lookup", f"{second.hit_blocks} of {len(keys)} blocks cached ({tiers}): {outcome}")
    if second.hit_blocks != len(keys):
        raise click.ClickException("committed blocks were not found by lookup")

    with client.acquire(second.hit_keys(keys)) as read:
        equal = read.ready == len(keys) and all(
            np.array_equal(page.view(np.uint8), values.view(np.uint8)) for page, values in zip(read.pages, kv)
        )
        say("acquire", f"lease {read.lease_id}: {read.ready} pages ready, {read.promoted} promoted; "
            f"bytes equal to what was written: {'yes' if equal else 'NO'}")
        if not equal:
            raise click.ClickException("pages read back differ from the pages written")
        lease_id = read.lease_id
    say("release", f"lease {lease_id} released")

    say("stats", "")
    echo(render_stats(client.stats()))


def render_stats(stats: Stats) -> str:
    """A short per-tier table of the daemon's pools."""
    lines = [f"{'':4}daemon {stats.version}: {stats.sessions} sessions, {stats.leases} leases"]
    header = ("tier", "capacity", "free", "cached", "pinned", "hits", "promoted", "demoted")
    for pool in stats.pools:
        rows = [header] + [
            (t.tier.label, t.capacity_pages, t.free_pages, t.cached_pages, t.pinned_pages, t.hits, t.promotions, t.demotions)
            for t in pool.tiers
        ]
        cells = [[str(c) for c in row] for row in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
        lines.append(f"{'':4}pool {pool.pool_id}: {pool.lookup_blocks} blocks looked up, {pool.miss_blocks} missed")
        for r in cells:
            lines.append(f"{'':4}" + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


@click.command("demo", short_help="Start a throwaway daemon and walk one prompt through the cache.",
               epilog="\b\nExample:\n  kvtier demo --host-size 16Mi --disk-size 64MiB")
@click.option("--prompt", default=DEMO_PROMPT, show_default=False, help="Text whose UTF-8 bytes serve as token ids.")
@click.option("--host-size", type=Size(), default="16MiB", show_default=True, metavar="SIZE",
              help="Host tier of the demo daemon (16MiB, 16Mi, 1GiB).")
@click.option("--disk-size", type=Size(), default="64MiB", show_default=True, metavar="SIZE",
              help="Disk tier of the demo daemon.")
def demo(prompt: str, host_size: str, disk_size: str) -> None:
    """Start a temporary daemon, run one client round trip through it step by step, stop it."""
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as workdir:
        daemon = ChildDaemon(workdir, host_size=host_size, disk_size=disk_size,
                             arena_prefix=f"kvtier-demo-{uuid.uuid4().hex[:8]}")
        click.echo(f"kvtier demo: daemon pid {daemon.proc.pid} on {daemon.target} (host {host_size}, disk {disk_size})")
        try:
            daemon.wait_serving(START_TIMEOUT)
            with KVTierClient(daemon.target, name="kvtier demo", backoff=Backoff(total=10.0)) as client:
                round_trip(client, prompt)
        except ChildDaemonError as exc:
            daemon.stop(STOP_TIMEOUT)
            raise click.ClickException(str(exc)) from None
        except BaseException:
            daemon.stop(STOP_TIMEOUT)
            click.echo(f"daemon log (last lines):\n{daemon.log_tail()}", err=True)
            raise
        try:
            code = daemon.stop(STOP_TIMEOUT)
        except ChildDaemonError as exc:
            raise click.ClickException(str(exc)) from None
        if code != 0:
            raise click.ClickException(f"daemon exited with code {code} after SIGTERM:\n{daemon.log_tail()}")
        click.echo(f"daemon stopped by SIGTERM, exit code {code}")
