"""Operator commands that talk to a running daemon: `kvtier stats` and `kvtier health-check`."""
from __future__ import annotations

import json
import os
import sys
import time

import click
import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.proto.v1 import kvtier_pb2_grpc

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


_TIER_NAMES = {pb.TIER_DEVICE: "device", pb.TIER_HOST: "host", pb.TIER_DISK: "disk"}


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
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines += ["  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join(lines)


@click.command("stats")
@_connection_options
@click.option("--token", envvar="KVTIER_TOKEN", help="Bearer token, when the daemon requires one.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw stats as JSON.")
@click.option("--watch", type=float, default=None, metavar="SECONDS", help="Refresh every SECONDS until interrupted.")
def stats(socket: str | None, target: str | None, tls_ca: str | None, tls_cert: str | None, tls_key: str | None, token: str | None, as_json: bool, watch: float | None) -> None:
    """Show per-tier capacity, use, hit rates and movement, plus sessions and leases.

    Used = capacity - free; leased = borrowed (writing) + pinned by read leases; of the cached
    pages, loading ones are on their way in and held ones were loaded ahead of use."""
    address = _target(socket, target)
    channel = _channel(address, tls_ca, tls_cert, tls_key)
    stub = kvtier_pb2_grpc.KVTierStub(channel)
    metadata = [("authorization", f"Bearer {token}")] if token else None
    try:
        while True:
            try:
                reply = stub.Stats(pb.StatsRequest(), timeout=5.0, metadata=metadata)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    raise click.ClickException(f"no kvtier daemon answers at {address}; start one with `kvtier serve` or pass --socket/--target")
                raise click.ClickException(f"{exc.code().name}: {exc.details()}")
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
