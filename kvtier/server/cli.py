"""`kvtier serve`: run the daemon. Every option can also come from the TOML file given with
--config or from a KVTIER_<OPTION> environment variable (flags win; docs/configuration.md)."""
from __future__ import annotations

import os
import sys

import click

from kvtier.server.config import ConfigError, load_config


@click.command("serve")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), envvar="KVTIER_CONFIG", help="TOML configuration file.")
@click.option("--socket", help="Unix socket path (created with mode 0660). Default: $XDG_RUNTIME_DIR/kvtier/kvtier.sock.")
@click.option("--tcp", help="Also listen on HOST:PORT over TLS (needs --tls-cert/--tls-key, or --insecure).")
@click.option("--tls-cert", help="PEM certificate for TCP.")
@click.option("--tls-key", help="PEM private key for TCP.")
@click.option("--tls-client-ca", help="PEM CA: require client certificates it signed (mutual TLS).")
@click.option("--insecure", is_flag=True, default=None, help="Allow plaintext TCP (trusted loopback only).")
@click.option("--auth", type=click.Choice(["tokens", "none"]), help="Namespace authorisation. Default: tokens if --tokens-file, else none.")
@click.option("--tokens-file", help='TOML file: [tokens] "<token>" = ["namespace", ...].')
@click.option("--cache-dir", help="Disk tier directory. Default: $XDG_CACHE_HOME/kvtier.")
@click.option("--host-size", help="Host tier size per layout, e.g. 8GiB. Default 1GiB.")
@click.option("--disk-size", help="Disk tier size per layout, e.g. 100GiB; 0 for none. Default 8GiB.")
@click.option("--device-size", help="GPU HBM per layout for the device tier, e.g. 40GiB; needs CUDA and CuPy. Default 0 (no device tier).")
@click.option("--gpu", type=int, help="CUDA device index of the device tier. Default 0.")
@click.option("--policy", type=click.Choice(["lru", "prefix"]), help="Eviction policy. Default lru.")
@click.option("--write-through/--write-back", default=None, help="Copy pages to disk at commit, or only when evicted (default).")
@click.option("--fsync", type=click.Choice(["batch", "interval", "never"]), help="When disk pages become durable: before their index commits (batch, default), every --fsync-interval, or never.")
@click.option("--fsync-interval", help="Flush period for --fsync interval. Default 1s.")
@click.option("--io-depth", type=int, help="Disk reads and writes in flight per pool. Default 8.")
@click.option("--max-queued-prefetch", type=int, help="Prefetch loads queued per pool; more hints are dropped. Default 1024 (four 4,096-token prefixes of 16-token pages).")
@click.option("--prefetch-hold", help="How long a prefetched page is kept unless acquired. Default 10s.")
@click.option("--session-timeout", help="Release a silent client's leases after this long. Default 3s.")
@click.option("--drain-timeout", help="On SIGTERM, wait this long for leases to be released. Default 10s.")
@click.option("--metrics-port", type=int, help="Serve Prometheus metrics on this port (0 = off).")
@click.option("--metrics-host", help="Address for the metrics endpoint. Default 127.0.0.1.")
@click.option("--arena-prefix", help="Name prefix of host arenas in /dev/shm. Default derived from the socket path.")
@click.option("--max-pools", type=int, help="Distinct page layouts served at once. Default 4.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), help="Default info.")
@click.option("--log-format", type=click.Choice(["json", "text"]), help="Default json.")
def serve(config_path: str | None, **flags) -> None:
    """Run the kvtier daemon until SIGTERM, then drain and exit."""
    from kvtier.server.daemon import run
    from kvtier.server.logs import setup_logging

    try:
        config = load_config(config_path, dict(os.environ), flags)
        setup_logging(config.log_level, config.log_format)
        code = run(config)
    except ConfigError as exc:
        click.echo(f"kvtier serve: {exc}", err=True)
        sys.exit(2)
    sys.exit(code)
