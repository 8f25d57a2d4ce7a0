"""`kvtier keeper`: the arena keeper as a process of its own, for where a keeper the daemon
spawns would die with it (a Kubernetes container: the keeper is then a native sidecar in
the daemon's pod, and the daemon connects to it through `keeper_socket`). It serves daemons
one after another until SIGTERM; what it is for: kvtier.mechanism.keeper."""
from __future__ import annotations

import logging
import os
import stat
import sys

import click

from kvtier.mechanism.keeper import KeeperError, keeper_status
from kvtier.mechanism.keeper_process import Keeper
from kvtier.units import parse_duration


def _check(path: str) -> int:
    """A probe: 0 when the keeper at `path` answers."""
    try:
        status = keeper_status(path)
    except KeeperError as exc:
        click.echo(str(exc), err=True)
        return 1
    if status is None:
        click.echo(f"no arena keeper listens at {path}", err=True)
        return 1
    held = "held by a daemon" if status.held else "no daemon holds it"
    click.echo(f"arena keeper at {path}: {status.files} files kept, {held}")
    return 0


def _take_path(path: str) -> None:
    """Make the socket's directory, and remove a socket a killed keeper left there; refuse
    when a keeper still answers at `path` (two would split the daemon's files)."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        status = keeper_status(path)
    except KeeperError as exc:
        raise click.ClickException(f"{exc}: another keeper holds {path}; stop it first") from None
    if status is not None:
        raise click.ClickException(f"another arena keeper serves {path} ({status.files} files kept): stop it first")
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise click.ClickException(f"{path} exists and is not a socket: give the keeper another path")
        os.unlink(path)  # a killed keeper's
    except FileNotFoundError:
        pass


@click.command("keeper", short_help="Keep the daemon's host memory across its crashes (a process of its own).",
               epilog="""\b
Examples:
  kvtier keeper --socket /run/kvtier-keeper/keeper.sock --window 5m
  kvtier keeper --check --socket /run/kvtier-keeper/keeper.sock
  kvtier serve --keeper-socket /run/kvtier-keeper/keeper.sock ...""")
@click.option("--socket", "socket_path", envvar="KVTIER_KEEPER_SOCKET", required=True, metavar="PATH",
              help="Where to listen (mode 0600: only this uid and root connect; the daemon's keeper_socket). "
                   "Default: $KVTIER_KEEPER_SOCKET.")
@click.option("--window", default="5m", show_default=True, metavar="DURATION",
              help="How long a crashed daemon's host memory is kept for the next daemon; then it is freed and the "
                   "keeper waits on.")
@click.option("--check", is_flag=True, help="Ask the keeper at --socket whether it answers (exit 0) and what it keeps; "
                                            "a liveness or startup probe.")
def keeper(socket_path: str, window: str, check: bool) -> None:
    """Hold a kvtier daemon's host memory files so that they outlive its crash, and hand them
    to the next daemon that connects; a clean stop of the daemon frees them. Runs until
    SIGTERM or SIGINT."""
    path = os.path.abspath(socket_path)
    if check:
        sys.exit(_check(path))
    try:
        seconds = parse_duration(window)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--window") from None
    if seconds <= 0:
        raise click.BadParameter("must be positive (a keeper that keeps nothing is no keeper)", param_hint="--window")
    _take_path(path)
    logging.basicConfig(level=logging.INFO, format="kvtier keeper: %(message)s")
    logging.getLogger(__name__).info("listening at %s; a crashed daemon's files are kept %.0f s", path, seconds)
    Keeper(path, seconds, standalone=True).serve()


if __name__ == "__main__":
    keeper(prog_name="kvtier keeper")
