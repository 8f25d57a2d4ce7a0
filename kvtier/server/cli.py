"""`kvtier serve`: run the daemon. Every option can also come from the TOML file given with
--config or from a KVTIER_<OPTION> environment variable (flags win; docs/configuration.md).
The flags are made from kvtier.server.config.OPTIONS."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable

import click

from kvtier.server.config import BOOL, INT, OPTIONS, PATH, ConfigError, Option, load_config


def _flag(option: Option) -> Callable:
    """A click option for one config option. Its default is None ("not given"), so that the
    TOML file and the environment still count; --help shows the real default."""
    help = f"{option.help}  [env var: {option.env}; default: {option.default_text}]"
    if option.kind is BOOL:
        decl = f"{option.flag}/--{option.off_flag}" if option.off_flag else option.flag
        return click.option(decl, option.key, is_flag=True, default=None, help=help)
    closed = option.kind.choices and not option.kind.extensible  # a registry's names are checked by the kind
    if closed:
        kind: click.ParamType = click.Choice(option.kind.choices)
    elif option.kind is INT:
        kind = click.INT
    elif option.kind is PATH:  # a str as before, and the shell completes it as a path
        kind = click.Path(dir_okay=option.key == "cache_dir")
    else:
        kind = click.STRING
    return click.option(option.flag, option.key, type=kind, default=None, help=help,
                        metavar=None if closed else option.metavar or option.kind.metavar)


def _config_flags(command: Callable) -> Callable:
    for option in reversed(OPTIONS):
        command = _flag(option)(command)
    return command


@click.command("serve", short_help="Run the daemon (tiers, gRPC, fast lane) until SIGTERM.",
               epilog="""\b
Examples:
  kvtier serve --host-size 8GiB --disk-size 100GiB --cache-dir /var/cache/kvtier
  kvtier serve --socket /tmp/kvtier/kvtier.sock --session-timeout 5s --log-format text
  KVTIER_HOST_SIZE=2GiB kvtier serve --config /etc/kvtier/kvtier.toml
  kvtier serve --device-size 40GiB --cluster redis://10.0.0.5:6379 --metrics-port 9400""")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), envvar="KVTIER_CONFIG", show_envvar=True,
              metavar="PATH", help="TOML configuration file (flat keys as below, e.g. host_size = \"8GiB\").")
@_config_flags
def serve(config_path: str | None, **flags) -> None:
    """Run the kvtier daemon until SIGTERM, then drain and exit.

    Sizes: 8GiB, 512MiB, 1.5GB or bytes. Durations: 5s, 500ms, or seconds."""
    from kvtier.mechanism.formats import FormatRefused
    from kvtier.mechanism.keeper import KeeperError
    from kvtier.server.daemon import run
    from kvtier.server.logs import setup_logging

    try:
        config = load_config(config_path, dict(os.environ), flags)
        setup_logging(config.log.level, config.log.format)
        code = run(config)
    except (ConfigError, KeeperError, FormatRefused) as exc:  # the operator's to fix: one line, no traceback
        click.echo(f"kvtier serve: {exc}", err=True)
        sys.exit(2)
    sys.exit(code)
