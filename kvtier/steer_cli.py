"""`kvtier cache pin|unpin|retain|demote|drop`: an operator's cache-control hints on a prefix
(docs/cache-control.md), sent as a client would send them.

A hint belongs to a session's namespace and pool (Steer, docs/protocol.md), so the command
registers a short session in the namespace (its token must grant it) with the pool's own
layout, sends the one request and closes. A pin or retain without a TTL would end with that
session, a moment later: these commands ask for --ttl.
"""
from __future__ import annotations

import json
from collections.abc import Callable

import click
from kvtier_client import KVTierClient
from kvtier_client.errors import KVTierError, Unavailable
from kvtier_client.keys import ALGORITHMS, DEFAULT_ALGORITHM, BlockKey
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.steering import MAX_TTL_SECONDS, PinMode, Priority, SteerResult
from kvtier_client.tiers import Tier
from kvtier_client.wire import layout_from_proto

from kvtier.admin import (
    Duration, _ask, _connection_options, _hex_keys, _keys_of, _target, _token_ids, _token_option, connect, tls_config,
)

#: Calls one KVTierClient method on the keys: what each command asks for.
Call = Callable[[KVTierClient, list[BlockKey]], SteerResult]


@click.group("cache", short_help="Pin, retain, demote or drop a cached prefix (cache control).",
             epilog="""\b
Examples:
  kvtier cache pin --namespace my-model/tenant-a --ttl 1h 64cfe407263f52ded92a449797f627db
  kvtier cache retain --namespace my-model/tenant-a --priority cold --ttl 10m --tokens-file prompt.txt
  kvtier cache demote --namespace my-model/tenant-a --tokens 1,2,3,4 --block-tokens 16
  kvtier cache drop --namespace my-model/tenant-a 64cfe407263f52ded92a449797f627db --json""")
def cache() -> None:
    """Tell the daemon how to treat a prefix's cached blocks, as a client can: pin them (soft:
    evicted last; hard: never evicted from host, within the namespace's guaranteed host
    pages), retain them as cold or high, unpin them, demote them to a slower tier, or drop
    them. Name the blocks as `kvtier stats why` does: KEYs in hex, or the prompt's token ids.
    `kvtier stats` shows each namespace's hinted blocks; `kvtier stats why` a block's hint."""


def _block_options(f):
    """The options every `kvtier cache` command shares: the daemon, the namespace and pool,
    the blocks (as `kvtier stats why` takes them) and --json."""
    for option in reversed([
        click.argument("keys", nargs=-1, metavar="[KEY]..."),
        _connection_options,
        _token_option,
        click.option("--namespace", required=True, metavar="NAME",
                     help="The namespace the blocks are cached in (the token must grant it)."),
        click.option("--pool", "pool_id", default="", metavar="ID",
                     help="Pool (layout) id, as `kvtier stats` lists them. Default: the namespace's only pool."),
        click.option("--tokens", "token_list", metavar="ID,ID,...", help="The prompt's token ids, instead of KEYs."),
        click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False), metavar="PATH",
                     help="A file of the prompt's token ids separated by whitespace, instead of KEYs."),
        click.option("--salt", default="", metavar="SALT",
                     help="With --tokens: the client's cache salt, as text.  [default: none]"),
        click.option("--block-tokens", type=click.IntRange(min=1), default=None, metavar="N",
                     help="With --tokens: tokens per block. Default: the pool's block size."),
        click.option("--algorithm", type=click.Choice(ALGORITHMS), default=DEFAULT_ALGORITHM, show_default=True,
                     help="The block-key hash the namespace's clients use."),
        click.option("--json", "as_json", is_flag=True, help="Print the result as JSON."),
    ]):
        f = option(f)
    return f


_TTL_HELP = (f"How long the hint lasts (a duration: 90s, 10m, 1h; at most {MAX_TTL_SECONDS / 86400:.0f} days). "
             "Required: a hint without one ends with the session that set it, and this command's ends as it exits.")
_ttl_option = click.option("--ttl", type=Duration(minimum=0, open_min=True), required=True, metavar="DURATION",
                           help=_TTL_HELP)


@cache.command("pin", short_help="Keep a prefix cached: evicted last (soft) or never from host (hard).")
@_block_options
@click.option("--mode", type=click.Choice([m.value for m in PinMode]), default=PinMode.SOFT.value, show_default=True,
              help="soft: evicted last, in every tier; hard: never evicted from host, charged to the namespace's "
                   "guaranteed_host_pages (refused past them; disk-only blocks are brought into host).")
@_ttl_option
def pin(mode: str, ttl: float, **opts) -> None:
    """Pin the cached blocks of a prefix for --ttl."""
    _run("pin", f"{mode}, {ttl:g} s", lambda kv, keys: kv.pin(keys, mode=PinMode(mode), ttl=ttl), **opts)


@cache.command("unpin", short_help="Clear the pins and retains on a prefix.")
@_block_options
def unpin(**opts) -> None:
    """Clear every hint (pin or retain) on the blocks of a prefix: the eviction policy alone
    ranks them again."""
    _run("unpin", "", lambda kv, keys: kv.unpin(keys), **opts)


@cache.command("retain", short_help="Rank a prefix for eviction: cold (first) or high (after the rest).")
@_block_options
@click.option("--priority", type=click.Choice([p.label for p in Priority]), required=True,
              help="cold: evicted first; high: evicted after blocks without a hint; normal: no hint (as unpin).")
@_ttl_option
def retain(priority: str, ttl: float, **opts) -> None:
    """Retain the cached blocks of a prefix in a priority class for --ttl."""
    _run("retain", f"{priority}, {ttl:g} s", lambda kv, keys: kv.retain(keys, Priority.parse(priority), ttl=ttl), **opts)


@cache.command("demote", short_help="Move a prefix's pages down now (to host, or to disk).")
@_block_options
@click.option("--tier", type=click.Choice([Tier.HOST.label, Tier.DISK.label]), default=Tier.DISK.label,
              show_default=True, help="host: off the device; disk: written to disk first, then off host (and device).")
def demote(tier: str, **opts) -> None:
    """Move the cached pages of a prefix below the faster tiers now. Leased and hard-pinned
    blocks are skipped (the result says how many)."""
    _run("demote", f"to {tier}", lambda kv, keys: kv.demote(keys, tier=Tier.parse(tier)), **opts)


@cache.command("drop", short_help="Forget a prefix's pages in every tier of this node now.")
@_block_options
def drop(**opts) -> None:
    """Drop the cached pages of a prefix from every tier of this node (a shared cluster tier
    keeps its own). Leased blocks are skipped. `kvtier stats why` then says "a drop hint"."""
    _run("drop", "", lambda kv, keys: kv.drop(keys), **opts)


def _run(action: str, detail: str, call: Call, *, keys: tuple[str, ...], socket: str | None, target: str | None,
         tls_ca: str | None, tls_cert: str | None, tls_key: str | None, token: str | None, namespace: str,
         pool_id: str, token_list: str | None, tokens_file: str | None, salt: str, block_tokens: int | None,
         algorithm: str, as_json: bool) -> None:
    token_ids = _token_ids(token_list, tokens_file)
    if (token_ids is None) == (not keys):
        raise click.UsageError("give the block KEYs in hex, or the prompt's --tokens / --tokens-file (one of them)")
    conn = connect(socket, target, tls_ca, tls_cert, tls_key, token)
    try:
        pool = _pool(_ask(conn, "Stats", pb.StatsRequest()), namespace, pool_id)
    finally:
        conn.close()
    if token_ids is None:
        block_list = _hex_keys(keys)
    else:
        block_list = _keys_of(token_ids, block_tokens or pool.layout.block_tokens, salt, algorithm)
    tls = tls_config(tls_ca, tls_cert, tls_key)
    try:
        with KVTierClient(_target(socket, target), token=token, tls=tls, insecure=tls is None, name=f"kvtier cache {action}",
                          map_arena=False, timeout=10.0) as kv:
            kv.register(namespace, layout_from_proto(pool.layout), algorithm=algorithm)
            result = call(kv, block_list)
    except Unavailable as exc:
        raise click.ClickException(f"the daemon did not answer: {exc}") from None
    except KVTierError as exc:
        raise click.ClickException(f"{exc.code}: {exc}") from None
    except ValueError as exc:  # a request the client refuses before sending (the daemon would too)
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps({"action": action, "namespace": namespace, "pool_id": pool.pool_id,
                               "keys": len(block_list), "applied": result.applied, "missing": result.missing,
                               "skipped": result.skipped, "note": result.note}))
        return
    what = f"{action} ({detail})" if detail else action
    line = (f"{what}: {len(block_list)} blocks in namespace {namespace}, pool {pool.pool_id}: {result.applied} applied, "
            f"{result.missing} not cached here, {result.skipped} skipped")
    click.echo(line + (f" ({result.note})" if result.note else ""))


def _pool(stats: pb.StatsResponse, namespace: str, pool_id: str) -> pb.PoolStats:
    """--pool, or the one pool the namespace has blocks in, or the daemon's only pool."""
    if pool_id:
        found = [p for p in stats.pools if p.pool_id == pool_id]
    else:
        found = [p for p in stats.pools if any(ns.namespace == namespace for ns in p.namespaces)] or list(stats.pools)
    if len(found) != 1:
        known = ", ".join(f"{p.pool_id} ({p.layout.block_tokens} tokens/block)" for p in stats.pools) or "none yet"
        asked = f"no pool {pool_id}" if pool_id else f"namespace {namespace} is in {len(found)} pools"
        raise click.UsageError(f"{asked}: pick one with --pool (pools: {known})")
    return found[0]
