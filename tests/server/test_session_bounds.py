"""Sessions are bounded: in all (`max_sessions`) and per credential (a quarter of them per
token), so a client that keeps heartbeating cannot hold sessions without end (each holds a
table entry, and a same-host one an arena descriptor), and one tenant cannot take every
place. Real daemon, real clients; old code opened every session asked for."""
from __future__ import annotations

import pytest
from kvtier_client import KVTierClient, PageLayout
from kvtier_client.errors import CapacityError

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=32, block_tokens=16)
TOKEN_A = "token-a-7c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f"
TOKEN_B = "token-b-0f9e8d7c6b5a49382716f5e4d3c2b1a0"


def open_until_refused(target: str, namespace: str, token: str | None, at_most: int) -> tuple[list, str]:
    """Registered clients until the daemon refused one, and its message."""
    opened = []
    for _ in range(at_most):
        client = KVTierClient(target, token=token)
        try:
            client.register(namespace, LAYOUT)
        except CapacityError as exc:
            client.close()
            return opened, str(exc)
        opened.append(client)
    for client in opened:
        client.close()
    raise AssertionError(f"{at_most} sessions opened; none refused")


def test_one_token_holds_a_quarter_of_the_sessions(daemons, tmp_path):
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = ["tenant-a"]\n"{TOKEN_B}" = ["tenant-b"]\n')
    daemon = daemons.start("--tokens-file", str(tokens), "--max-sessions", "8")
    mine, message = open_until_refused(daemon.target, "tenant-a", TOKEN_A, 8)
    theirs = []
    try:
        assert len(mine) == 2 and "a quarter of max_sessions (8)" in message and TOKEN_A not in message
        theirs, _ = open_until_refused(daemon.target, "tenant-b", TOKEN_B, 8)  # B's places were left to it
        assert len(theirs) == 2
        mine.pop().close()  # a closed session frees its place at once
        again = KVTierClient(daemon.target, token=TOKEN_A)
        again.register("tenant-a", LAYOUT)
        mine.append(again)
    finally:
        for client in mine + theirs:
            client.close()


def test_without_tokens_the_total_bounds_sessions(daemons):
    daemon = daemons.start("--max-sessions", "3")
    opened, message = open_until_refused(daemon.target, "tenant", None, 6)
    try:
        assert len(opened) == 3 and "raise --max-sessions" in message
    finally:
        for client in opened:
            client.close()


def test_max_sessions_must_be_positive(daemons):
    with pytest.raises(AssertionError, match="max_sessions must be at least 1"):
        daemons.start("--max-sessions", "0")
