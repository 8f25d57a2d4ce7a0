"""Reloading the tokens file: the parser's refusals, `Authorizer.reload` and `grants`, and
SIGHUP on a real daemon (new tokens and quotas at once; a broken file changes nothing;
quotas a pool cannot keep leave that pool's old ones)."""
from __future__ import annotations

import signal
import textwrap

import grpc
import pytest
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import expect_code, free_port, keys, pool_stats, register_request, scrape, value, wait_for

from kvtier.core import Quota
from kvtier.server.auth import Authorizer, load_access_table
from kvtier.server.config import AuthMode, ConfigError

TOKEN_A = "token-a-1d2c3b4a5f6e7d8c9b0a"
TOKEN_B = "token-b-0a9b8c7d6e5f4a3b2c1d"
TOKEN_C = "token-c-5e6f7a8b9c0d1e2f3a4b"
OTHER_LAYOUT = pb.PageLayout(layers=1, kv_heads=1, head_dim=64, block_tokens=16, dtype="float16", order="page_first")


def write(path, tokens: dict[str, list[str]], quotas: str = "") -> str:
    lines = ["[tokens]", *(f'"{t}" = {namespaces!r}'.replace("'", '"') for t, namespaces in tokens.items())]
    path.write_text("\n".join(lines) + "\n" + textwrap.dedent(quotas))
    return str(path)


# -- the file and the Authorizer, in process ---------------------------------------------
def test_quotas_are_read_with_the_tokens(tmp_path):
    path = write(tmp_path / "t.toml", {TOKEN_A: ["a"]}, """
        [namespaces.a]
        max_host_pages = 4096
        guaranteed_host_pages = 1024
        [namespaces."model/b"]
        max_disk_pages = 65536
    """)
    table = load_access_table(path, need_tokens=True)
    assert table.tokens == {TOKEN_A: frozenset({"a"})}
    assert table.quotas == {"a": Quota(max_host_pages=4096, guaranteed_host_pages=1024),
                            "model/b": Quota(max_disk_pages=65536)}


def test_quotas_without_tokens_for_auth_none(tmp_path):
    path = tmp_path / "q.toml"
    path.write_text("[namespaces.a]\nguaranteed_host_pages = 8\n")
    auth = Authorizer(AuthMode.NONE, str(path))
    assert auth.quotas == {"a": Quota(guaranteed_host_pages=8)}
    assert auth.grants(None, "anything")
    with pytest.raises(ConfigError, match="needs a \\[tokens\\] table"):
        Authorizer(AuthMode.TOKENS, str(path))


@pytest.mark.parametrize("body, message", [
    ("[namespaces.a]\nmax_host_page = 1\n", "unknown key 'max_host_page'; use max_host_pages, max_disk_pages"),
    ("[namespaces.a]\nmax_host_pages = -1\n", "max_host_pages must be a whole number of pages"),
    ("[namespaces.a]\nmax_host_pages = \"8\"\n", "max_host_pages must be a whole number of pages"),
    ("[namespaces.a]\nmax_host_pages = true\n", "max_host_pages must be a whole number of pages"),
    ("[namespaces.a]\nmax_host_pages = 4\nguaranteed_host_pages = 8\n", "guaranteed_host_pages (8) exceeds max_host_pages (4)"),
    ("namespaces = 3\n", "namespaces holds one table per namespace"),
    ("[namespaces]\na = 3\n", 'namespaces."a"] must be a table of page counts'),
    ("[quotas.a]\nmax_host_pages = 1\n", "unknown table or key 'quotas'"),
    ('[namespaces.a]\ncodec = "fp9"\n', "unknown codec 'fp9'; known: identity, zstd, k16v8, fp8, int4"),
])
def test_bad_quotas_are_refused_with_the_file_and_key(tmp_path, body, message):
    path = tmp_path / "t.toml"
    path.write_text(f'{body}[tokens]\n"{TOKEN_A}" = ["a"]\n')
    with pytest.raises(ConfigError) as info:
        load_access_table(str(path), need_tokens=True)
    assert str(path) in str(info.value) and message in str(info.value)


def test_a_namespace_codec_is_read_apart_from_its_quota(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(f'[namespaces.a]\ncodec = "fp8"\nmax_host_pages = 2\n[namespaces.b]\ncodec = "zstd"\n'
                    f'[tokens]\n"{TOKEN_A}" = ["a"]\n')
    table = load_access_table(str(path), need_tokens=True)
    assert table.codecs == {"a": "fp8", "b": "zstd"}
    assert table.quotas == {"a": Quota(max_host_pages=2), "b": Quota()}


def test_reload_swaps_the_table_or_keeps_it(tmp_path):
    path = tmp_path / "t.toml"
    write(path, {TOKEN_A: ["a"], TOKEN_B: ["*"]})
    auth = Authorizer(AuthMode.TOKENS, str(path))
    assert auth.grants(TOKEN_A, "a") and not auth.grants(TOKEN_A, "b") and auth.grants(TOKEN_B, "b")
    assert not auth.grants(None, "a") and not auth.grants(TOKEN_C, "a")

    write(path, {TOKEN_C: ["a"]}, "[namespaces.a]\nmax_host_pages = 8\n")
    table = auth.reload()
    assert set(table.tokens) == {TOKEN_C} and auth.quotas == {"a": Quota(max_host_pages=8)}
    assert not auth.grants(TOKEN_A, "a") and auth.grants(TOKEN_C, "a")

    path.write_text("[tokens\n")
    with pytest.raises(ConfigError, match=str(path)):
        auth.reload()
    assert auth.grants(TOKEN_C, "a") and auth.quotas == {"a": Quota(max_host_pages=8)}


# -- SIGHUP on a real daemon --------------------------------------------------------------
def reloads(port: int, result: str) -> float:
    return value(scrape(port)[1], "kvtier_reloads_total", result=result)


def hang_up(daemon, port: int, result: str) -> None:
    """SIGHUP, then wait until the daemon counted the reload as `result`."""
    before = reloads(port, result)
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: reloads(port, result) == before + 1, 10, f"a reload counted as {result}")


def quota(conn, pool: str, namespace: str) -> pb.NamespaceTierStats:
    ns = next(n for n in pool_stats(conn.state(), pool).namespaces if n.namespace == namespace)
    return next(t for t in ns.tiers if t.tier == pb.TIER_HOST)


def test_sighup_applies_new_tokens_and_quotas(daemons, connect, tmp_path):
    port = free_port()
    path = tmp_path / "t.toml"
    write(path, {TOKEN_A: ["a"], TOKEN_B: ["b"]})
    d = daemons.start("--tokens-file", str(path), "--metrics-port", str(port), host_size="256KiB", disk_size="1MiB")
    old = connect(d.target, token=TOKEN_A).session("a")
    pool = old.reply.pool_id
    old.put(keys("a", 16))
    assert (reloads(port, "ok"), reloads(port, "error")) == (0, 0)

    write(path, {TOKEN_B: ["b"], TOKEN_C: ["a"]}, "[namespaces.a]\nmax_host_pages = 8\n")
    hang_up(d, port, "ok")
    # The removed token stops at once: no new session, and its open session is refused too.
    expect_code(grpc.StatusCode.UNAUTHENTICATED, old.conn.call, "Register", register_request("a"))
    expect_code(grpc.StatusCode.PERMISSION_DENIED, old.lookup, keys("a", 1))
    new = connect(d.target, token=TOKEN_C)
    s = new.session("a")
    assert (quota(new, pool, "a").max_pages, quota(new, pool, "a").pages) == (8, 16)
    s.put(keys("a-more", 1))  # the quota applies from a's next allocation: it evicts its own pages
    assert quota(new, pool, "a").pages == 8
    # A pool made after the reload gets the quotas too.
    second = new.session("a", layout=OTHER_LAYOUT)
    second.put(keys("a-second", 1))
    assert quota(new, second.reply.pool_id, "a").max_pages == 8
    assert "reloaded the tokens file" in d.log()

    # A broken file changes nothing and counts an error.
    path.write_text("[tokens\n")
    hang_up(d, port, "error")
    assert "reload failed; keeping the previous tokens and quotas" in d.log() and str(path) in d.log()
    assert connect(d.target, token=TOKEN_C).register("a").session_id
    expect_code(grpc.StatusCode.UNAUTHENTICATED, old.conn.call, "Register", register_request("a"))
    assert quota(new, pool, "a").max_pages == 8

    # Quotas a pool cannot keep (a guarantee larger than its host tier): that pool keeps its
    # old ones, the tokens apply, and the reload counts as an error.
    write(path, {TOKEN_C: ["a"], TOKEN_A: ["a"]}, "[namespaces.a]\nguaranteed_host_pages = 100000\n")
    hang_up(d, port, "error")
    assert "reload partly failed" in d.log()
    assert (quota(new, pool, "a").max_pages, quota(new, pool, "a").guaranteed_pages) == (8, 0)
    assert connect(d.target, token=TOKEN_A).register("a").session_id
    assert d.proc.poll() is None
