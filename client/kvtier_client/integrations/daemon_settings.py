"""What every engine integration (and the `kvtier` commands) reads the same way to reach the
daemon: its default socket and target (where `kvtier serve` listens) and a token given
inline or in a file."""
from __future__ import annotations

import os
from pathlib import Path


def default_socket() -> str:
    """Where `kvtier serve` listens unless told otherwise (its `socket` setting), and where
    the `kvtier` commands look for it: $XDG_RUNTIME_DIR/kvtier/kvtier.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvtier-{os.getuid()}"
    return os.path.join(runtime, "kvtier", "kvtier.sock")


def default_target() -> str:
    """$KVTIER_TARGET, else the daemon's default socket."""
    return os.environ.get("KVTIER_TARGET") or f"unix://{default_socket()}"


def resolve_token(token: str | None, token_file: str | None, who: str) -> str | None:
    """The token given inline or read from `token_file` (not both); `who` names the
    integration in the ValueError that says what is wrong."""
    if token and token_file:
        raise ValueError(f"{who}: give either token or token_file, not both")
    if not token_file:
        return token or None
    try:
        text = Path(token_file).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{who}: cannot read token_file {token_file!r}: {exc}") from None
    if not text:
        raise ValueError(f"{who}: token_file {token_file!r} is empty")
    return text
