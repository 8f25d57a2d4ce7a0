"""Operator commands that talk to a running daemon: `kvtier stats` (and `kvtier stats why`) and `kvtier health-check`."""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

import click
import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvtier_client.keys import ALGORITHMS, DEFAULT_ALGORITHM, block_keys
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.proto.v1 import kvtier_pb2_grpc
from kvtier_client.results import BlockExplanation, BlockReason, Explanation, hashing

from kvtier.server.config import default_socket


def _target(socket: str | None, target: str | None) -> str:
    if target:
        return target
    return "unix://" + os.path.abspath(socket or os.environ.get("KVTIER_SOCKET") or default_socket())


def _read_pem(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise click.ClickException(f"cannot read {flag} {path} ({exc.strerror})") from None


def _channel(target: str, tls_ca: str | None, tls_cert: str | None, tls_key: str | None) -> grpc.Channel:
    """Plaintext for a Unix socket; TLS (mutual with --tls-cert/--tls-key) for a TCP daemon."""
    if bool(tls_cert) != bool(tls_key):
        raise click.ClickException("--tls-cert and --tls-key go together (a client certificate for mutual TLS)")
    if tls_ca or tls_cert:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read_pem(tls_ca, "--tls-ca") if tls_ca else None,
            private_key=_read_pem(tls_key, "--tls-key") if tls_key else None,
            certificate_chain=_read_pem(tls_cert, "--tls-cert") if tls_cert else None,
        )
        return grpc.secure_channel(target, credentials)
    return grpc.insecure_channel(target)


def _connection_options(f):
    f = click.option("--tls-key", help="PEM key of --tls-cert.")(f)
    f = click.option("--tls-cert", help="PEM client certificate, for a daemon that requires mutual TLS.")(f)
    f = click.option("--tls-ca", help="PEM CA to verify a TCP daemon's certificate.")(f)
    f = click.option("--target", help="gRPC target instead of the socket, e.g. host:7070 or unix:///path.")(f)
    f = click.option("--socket", help="Daemon socket. Default: $KVTIER_SOCKET or $XDG_RUNTIME_DIR/kvtier/kvtier.sock.")(f)
    return f


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


_TIER_NAMES = {pb.TIER_DEVICE: "device", pb.TIER_HOST: "host", pb.TIER_DISK: "disk", pb.TIER_CLUSTER: "cluster"}


def _table(rows: list[tuple[str, ...]], left: int = 1, text_last: bool = False) -> list[str]:
    """Rows as aligned lines: figures right-aligned, the first `left` columns (and the last,
    with `text_last`) left-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    last = len(widths) - 1

    def cell(i: int, text: str) -> str:
        return text.ljust(widths[i]) if i < left or (text_last and i == last) else text.rjust(widths[i])

    return [("  " + "  ".join(cell(i, c) for i, c in enumerate(r))).rstrip() for r in rows]


_MISS_REASONS = (("never_stored", "never stored"), ("evicted", "evicted"), ("corrupt", "corrupt"),
                 ("beyond_prefix", "beyond prefix"))


def _misses(ns: pb.NamespaceStats) -> str:
    """Missed blocks by reason, largest first: "3 never stored, 1 evicted"."""
    counts = sorted(((ns.misses.get(key, 0), label) for key, label in _MISS_REASONS), key=lambda c: -c[0])
    return ", ".join(f"{n} {label}" for n, label in counts if n) or "-"


def _namespace_rows(pool: pb.PoolStats) -> list[tuple[str, ...]]:
    """One row per namespace and tier; the namespace's lookups and misses on its first row."""
    rows: list[tuple[str, ...]] = [("namespace", "tier", "pages", "max", "guaranteed", "hits", "evicted", "looked up",
                                    "missed by reason")]
    for ns in pool.namespaces:
        for i, t in enumerate(ns.tiers):
            tail = (str(ns.lookup_blocks), _misses(ns)) if i == 0 else ("", "")
            rows.append((
                ns.namespace, _TIER_NAMES.get(t.tier, str(t.tier)), str(t.pages), str(t.max_pages or "-"),
                str(t.guaranteed_pages or "-"), str(t.hits), str(t.evictions), *tail,
            ))
    return rows


def render_stats(reply: pb.StatsResponse) -> str:
    lines = [
        f"kvtier {reply.version} · up {reply.uptime_seconds:.0f}s · {reply.sessions} sessions · {reply.leases} leases"
    ]
    if not reply.pools:
        lines.append("no pools yet: a pool is created when the first client registers a layout")
    for pool in reply.pools:
        lay = pool.layout
        lines.append(
            f"pool {pool.pool_id}: {lay.layers} layers x {lay.kv_heads} kv heads x {lay.head_dim} dim, "
            f"{lay.block_tokens} tokens/page, {lay.dtype}, page {_human_bytes(pool.page_bytes)}; "
            f"{pool.lookup_blocks} blocks looked up, {pool.miss_blocks} missed"
        )
        header = ("tier", "capacity", "used", "leased", "cached", "loading", "held", "hit rate", "evicted", "promoted",
                  "demoted", "moved in", "corrupt", "io errors", "read/s")
        rows = [header]
        for t in pool.tiers:
            used = t.capacity_pages - t.free_pages
            hit_rate = t.hits / pool.lookup_blocks if pool.lookup_blocks else 0.0
            rows.append((
                _TIER_NAMES.get(t.tier, str(t.tier)), str(t.capacity_pages), str(used), str(t.writing_pages + t.pinned_pages),
                str(t.cached_pages), str(t.loading_pages), str(t.held_pages), f"{hit_rate:.3f}", str(t.evictions),
                str(t.promotions), str(t.demotions), _human_bytes(t.bytes_in), str(t.corrupt_pages), str(t.io_errors),
                _human_bytes(int(t.read_bytes_per_second)),
            ))
        lines += _table(rows)
        if pool.namespaces:
            lines += _table(_namespace_rows(pool), left=2, text_last=True)
    return "\n".join(lines)


def _token_option(f):
    return click.option("--token", envvar="KVTIER_TOKEN", help="Bearer token, when the daemon requires one.")(f)


def _metadata(token: str | None) -> list[tuple[str, str]] | None:
    return [("authorization", f"Bearer {token}")] if token else None


def _ask(call, request, address: str, metadata):
    """One RPC; a failure becomes the one-line error the command prints."""
    try:
        return call(request, timeout=5.0, metadata=metadata)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            raise click.ClickException(f"no kvtier daemon answers at {address}; start one with `kvtier serve` or pass --socket/--target")
        raise click.ClickException(f"{exc.code().name}: {exc.details()}")


#: Options of `kvtier stats` that, given before `why`, are its defaults.
_SHARED = ("socket", "target", "tls_ca", "tls_cert", "tls_key", "token", "as_json")


@click.group("stats", invoke_without_command=True)
@_connection_options
@_token_option
@click.option("--json", "as_json", is_flag=True, help="Print the raw stats as JSON.")
@click.option("--watch", type=float, default=None, metavar="SECONDS", help="Refresh every SECONDS until interrupted.")
@click.pass_context
def stats(ctx: click.Context, socket: str | None, target: str | None, tls_ca: str | None, tls_cert: str | None,
          tls_key: str | None, token: str | None, as_json: bool, watch: float | None) -> None:
    """Show per-tier capacity, use, hit rates and movement, plus sessions and leases, and each
    namespace's share (only the namespaces your token grants). `kvtier stats why` explains misses.

    Used = capacity - free; leased = borrowed (writing) + pinned by read leases; of the cached
    pages, loading ones are on their way in and held ones were loaded ahead of use."""
    if ctx.invoked_subcommand is not None:
        if watch:
            raise click.UsageError(f"--watch refreshes the stats table; it does not apply to `{ctx.invoked_subcommand}`")
        given = {name: value for name, value in ctx.params.items() if name in _SHARED and value}
        ctx.default_map = {ctx.invoked_subcommand: given}
        return
    address = _target(socket, target)
    channel = _channel(address, tls_ca, tls_cert, tls_key)
    stub = kvtier_pb2_grpc.KVTierStub(channel)
    try:
        while True:
            reply = _ask(stub.Stats, pb.StatsRequest(), address, _metadata(token))
            if as_json:
                click.echo(json.dumps(MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)))
            else:
                if watch:
                    click.echo("\x1b[2J\x1b[H", nl=False)
                click.echo(render_stats(reply))
            if not watch:
                return
            time.sleep(watch)
    except KeyboardInterrupt:
        pass
    finally:
        channel.close()


# -- kvtier stats why ----------------------------------------------------------------
@dataclass(frozen=True)
class Why:
    """An explanation with what the command knows besides it: the keys asked about, how they
    were hashed (None for keys given in hex), and blocks found under another algorithm."""

    namespace: str
    keys: list[bytes]
    explanation: Explanation
    asked: str | None  # "<algorithm> <block_tokens> tokens/block", as Explain's hashings
    other_algorithm: dict[int, str]  # block index -> the algorithm it was committed under instead


def _hex_keys(texts: tuple[str, ...]) -> list[bytes]:
    try:
        return [bytes.fromhex(t) for t in texts]
    except ValueError:
        raise click.BadParameter("keys are hex strings, e.g. 64cfe407263f52ded92a449797f627db", param_hint="KEY") from None


def _token_ids(token_list: str | None, tokens_file: str | None) -> list[int] | None:
    """The prompt's token ids from --tokens or --tokens-file; None when neither is given."""
    if token_list is not None and tokens_file is not None:
        raise click.UsageError("give --tokens or --tokens-file, not both")
    if tokens_file is not None:
        with open(tokens_file) as f:
            words, where = f.read().split(), f"--tokens-file {tokens_file}"
    elif token_list is not None:
        words, where = token_list.replace(",", " ").split(), "--tokens"
    else:
        return None
    try:
        return [int(w) for w in words]
    except ValueError:
        raise click.UsageError(f"{where}: token ids are integers (separated by commas or whitespace)") from None


def _pool_block_tokens(stats: pb.StatsResponse, pool_id: str) -> int:
    """--block-tokens left out: the block size of --pool, or of the daemon's only pool."""
    pools = [p for p in stats.pools if p.pool_id == pool_id] if pool_id else list(stats.pools)
    if len(pools) != 1:
        known = ", ".join(f"{p.pool_id} ({p.layout.block_tokens})" for p in stats.pools) or "none yet"
        raise click.UsageError(f"--tokens needs --block-tokens, or a --pool to take it from (pools: {known})")
    return pools[0].layout.block_tokens


def _keys_of(token_ids: list[int], block_tokens: int, salt: str, algorithm: str) -> list[bytes]:
    try:
        return list(block_keys(token_ids, block_tokens, salt=salt.encode(), algorithm=algorithm))
    except ValueError as exc:
        raise click.UsageError(f"cannot compute block keys: {exc}") from None


def _describe(block: BlockExplanation, other_algorithm: str | None) -> str:
    """One block's state in words."""
    where = block.tier.label if block.tier is not None else "?"
    reason = block.reason
    if reason is BlockReason.CACHED:
        return f"cached in {where}"
    if reason is BlockReason.EVICTED:
        whose = "own pressure" if block.own_pressure else "another namespace's pressure"
        return f"evicted from {where} {block.seconds_ago:.0f} s ago by {block.policy or '?'} ({whose})"
    if reason is BlockReason.CORRUPT:
        return f"dropped as corrupt from {where} {block.seconds_ago:.0f} s ago"
    if reason is BlockReason.OTHER_LAYOUT:
        return f"cached in another layout {block.pool_id} ({where})"
    if reason is BlockReason.BEYOND_PREFIX:
        return f"cached in {where}, but beyond the longest cached prefix"
    if other_algorithm is not None:
        return f"committed under another hash fingerprint ({other_algorithm})"
    return "never stored"


#: How the summary line names each kind of block, in its order.
_KINDS = {BlockReason.CACHED: "cached", BlockReason.EVICTED: "evicted", BlockReason.CORRUPT: "dropped as corrupt",
          BlockReason.NEVER_STORED: "never stored", BlockReason.OTHER_LAYOUT: "in another layout",
          BlockReason.BEYOND_PREFIX: "beyond the prefix"}
_OTHER_FINGERPRINT = "under another hash fingerprint"


def _summary(why: Why) -> str:
    """"8 blocks: 3 cached, 2 evicted, ..." in a fixed order."""
    kinds = [_OTHER_FINGERPRINT if b.index in why.other_algorithm else _KINDS[b.reason] for b in why.explanation.blocks]
    counts = [f"{kinds.count(kind)} {kind}" for kind in (*_KINDS.values(), _OTHER_FINGERPRINT) if kind in kinds]
    return f"{len(kinds)} blocks: " + (", ".join(counts) or "none asked")


def render_why(why: Why) -> str:
    ex = why.explanation
    pool = next((b.pool_id for b in ex.blocks if b.reason is not BlockReason.OTHER_LAYOUT and b.pool_id), None)
    lines = [f"namespace {why.namespace}" + (f", pool {pool}" if pool else "")
             + f": {ex.hit_blocks} of {len(why.keys)} blocks served (the longest cached prefix)"]
    rows = [(str(b.index), why.keys[b.index].hex()[:12], _describe(b, why.other_algorithm.get(b.index)))
            for b in ex.blocks]
    if rows:
        lines += _table(rows, left=0, text_last=True)
    lines.append(_summary(why))
    if ex.hashings and (why.asked is None or list(ex.hashings) != [why.asked]):
        asked = f"; you asked for {why.asked}" if why.asked else ""
        lines.append(f"clients of {why.namespace} registered with: {', '.join(ex.hashings)}{asked}")
    return "\n".join(lines)


def why_json(why: Why) -> dict:
    ex = why.explanation
    blocks = [
        {"index": b.index, "key": why.keys[b.index].hex(), "state": b.reason.value,
         "tier": b.tier.label if b.tier is not None else None, "pool_id": b.pool_id, "seconds_ago": b.seconds_ago,
         "policy": b.policy, "own_pressure": b.own_pressure, "other_algorithm": why.other_algorithm.get(b.index)}
        for b in ex.blocks
    ]
    return {"namespace": why.namespace, "hit_blocks": ex.hit_blocks, "blocks": blocks,
            "hashings": list(ex.hashings), "asked": why.asked}


def _under_other_algorithms(explain, ex: Explanation, token_ids: list[int], block_tokens: int, salt: str,
                            algorithm: str) -> dict[int, str]:
    """Blocks never stored under `algorithm` that the daemon knows under another one."""
    unexplained = {b.index for b in ex.blocks if b.reason is BlockReason.NEVER_STORED}
    found: dict[int, str] = {}
    for other in (a for a in ALGORITHMS if a != algorithm):
        if not unexplained:
            break
        for b in explain(_keys_of(token_ids, block_tokens, salt, other)).blocks:
            if b.index in unexplained and b.reason is not BlockReason.NEVER_STORED:
                found[b.index] = other
                unexplained.discard(b.index)
    return found


@stats.command("why")
@click.argument("keys", nargs=-1, metavar="[KEY]...")
@_connection_options
@_token_option
@click.option("--namespace", required=True, help="The namespace the prompt was cached in (the token must grant it).")
@click.option("--pool", "pool_id", default="",
              help="Pool (layout) id, as `kvtier stats` lists them. Default: the pool serving the longest prefix.")
@click.option("--tokens", "token_list", metavar="ID,ID,...", help="The prompt's token ids, instead of KEYs.")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False),
              help="A file of the prompt's token ids separated by whitespace, instead of KEYs.")
@click.option("--salt", default="", help="With --tokens: the client's cache salt, as text.")
@click.option("--block-tokens", type=click.IntRange(min=1), default=None,
              help="With --tokens: tokens per block. Default: the block size of --pool, or of the only pool.")
@click.option("--algorithm", type=click.Choice(ALGORITHMS), default=DEFAULT_ALGORITHM, show_default=True,
              help="With --tokens: the block-key hash the client uses.")
@click.option("--json", "as_json", is_flag=True, help="Print the explanation as JSON.")
def why(keys: tuple[str, ...], socket: str | None, target: str | None, tls_ca: str | None, tls_cert: str | None,
        tls_key: str | None, token: str | None, namespace: str, pool_id: str, token_list: str | None,
        tokens_file: str | None, salt: str, block_tokens: int | None, algorithm: str, as_json: bool) -> None:
    """Why is a prompt's KV (not) cached? One line per block: cached (and where), evicted
    (when, by which policy, under whose pressure), dropped as corrupt, never stored, cached in
    another layout, or beyond the longest cached prefix.

    Give the block KEYs in hex, or the prompt's token ids (--tokens, --tokens-file) with the
    client's --salt, --block-tokens and --algorithm: blocks never stored are then also looked
    for under the other hash algorithm."""
    token_ids = _token_ids(token_list, tokens_file)
    if (token_ids is None) == (not keys):
        raise click.UsageError("give the block KEYs in hex, or the prompt's --tokens / --tokens-file (one of them)")
    address = _target(socket, target)
    channel = _channel(address, tls_ca, tls_cert, tls_key)
    stub = kvtier_pb2_grpc.KVTierStub(channel)

    def explain(ks: list[bytes]) -> Explanation:
        request = pb.ExplainRequest(namespace=namespace, keys=ks, pool_id=pool_id)
        return Explanation.from_proto(_ask(stub.Explain, request, address, _metadata(token)))

    try:
        if token_ids is None:
            block_list = _hex_keys(keys)
            result = Why(namespace, block_list, explain(block_list), None, {})
        else:
            if block_tokens is None:
                block_tokens = _pool_block_tokens(_ask(stub.Stats, pb.StatsRequest(), address, _metadata(token)), pool_id)
            block_list = _keys_of(token_ids, block_tokens, salt, algorithm)
            ex = explain(block_list)
            others = _under_other_algorithms(explain, ex, token_ids, block_tokens, salt, algorithm)
            result = Why(namespace, block_list, ex, hashing(algorithm, block_tokens), others)
    finally:
        channel.close()
    click.echo(json.dumps(why_json(result)) if as_json else render_why(result))


@click.command("health-check")
@_connection_options
@click.option("--timeout", type=float, default=3.0, show_default=True, help="Seconds to wait for an answer.")
def health_check(socket: str | None, target: str | None, tls_ca: str | None, tls_cert: str | None, tls_key: str | None,
                 timeout: float) -> None:
    """Exit 0 only if the daemon reports SERVING (for probes and scripts)."""
    address = _target(socket, target)
    channel = _channel(address, tls_ca, tls_cert, tls_key)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        click.echo(f"NOT SERVING: no answer from {address} ({exc.code().name})", err=True)
        sys.exit(1)
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    click.echo(status)
    sys.exit(0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1)
