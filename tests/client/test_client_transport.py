"""Transports and credentials: bearer tokens, plaintext TCP on loopback, TLS and mutual TLS,
each against a real daemon configured for it."""
from __future__ import annotations

import socket

import numpy as np
import pytest
from pki import make_pki
from client_helpers import LAYOUT, as_bytes, kv_pages, tokens
from kvtier_client.remote import RemotePages
from kvtier_client import (
    Backoff,
    KVTierClient,
    KVTierError,
    PermissionDenied,
    TLSConfig,
    Unauthenticated,
    Unavailable,
)

TOKEN_A = "tenant-a-token-0123456789abcdef"
TOKEN_ANY = "operator-token-0123456789abcdef"

#: Fail fast when a handshake is refused instead of retrying for the default 30 s.
QUICK = Backoff(initial=0.05, maximum=0.2, total=1.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tokens_file(tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text(f'[tokens]\n"{TOKEN_A}" = ["tenant-a"]\n"{TOKEN_ANY}" = ["*"]\n')
    return path


def round_trip(client: KVTierClient, namespace: str, seed: int) -> None:
    """Write and read back pages: through the mapped arena, or over gRPC for a client that
    maps none (TCP: host memory is lent over the Unix socket only)."""
    client.register(namespace, LAYOUT)
    keys = client.block_keys(tokens(32, seed=seed))
    data = kv_pages(len(keys), LAYOUT, seed=seed)
    remote = None if client.map_arena else RemotePages(client)
    with client.borrow(len(keys)) as lease:
        if remote is None:
            for page, payload in zip(lease.pages, data):
                as_bytes(page)[:] = payload
        else:
            remote.write_pages(lease, list(data))  # raw bytes: any page-sized buffer will do
        lease.commit(keys)
    with client.acquire(keys) as lease:
        pages = lease.pages if remote is None else remote.read_pages(lease)
        for page, payload in zip(pages, data):
            np.testing.assert_array_equal(as_bytes(page), payload)


def test_bearer_token_authorises_namespaces(daemons, clients, tokens_file):
    d = daemons("--tokens-file", str(tokens_file))
    round_trip(clients(d.target, token=TOKEN_A), "tenant-a", seed=30)
    assert clients(d.target, token=TOKEN_A).stats().sessions >= 1  # Stats needs the token too

    with pytest.raises(Unauthenticated, match="token"):
        clients(d.target).register("tenant-a", LAYOUT)
    with pytest.raises(Unauthenticated):
        clients(d.target).stats()
    with pytest.raises(Unauthenticated):
        clients(d.target, token="not-a-token-at-all-0000").register("tenant-a", LAYOUT)
    with pytest.raises(PermissionDenied, match="tenant-b"):
        clients(d.target, token=TOKEN_A).register("tenant-b", LAYOUT)
    round_trip(clients(d.target, token=TOKEN_ANY), "tenant-b", seed=31)


def test_plaintext_tcp_on_loopback(daemons, clients):
    port = free_port()
    daemons("--tcp", f"127.0.0.1:{port}", "--insecure")
    with pytest.raises(KVTierError, match="map_arena=False"):  # host memory is lent over the Unix socket only
        clients(f"127.0.0.1:{port}", insecure=True).register("test/tcp", LAYOUT)
    round_trip(clients(f"127.0.0.1:{port}", insecure=True, map_arena=False), "test/tcp", seed=32)
    with pytest.raises(ValueError, match="either tls or insecure"):
        KVTierClient(f"127.0.0.1:{port}", insecure=True, tls=TLSConfig())


def test_tls_and_mutual_tls(daemons, clients, tmp_path, tokens_file):
    pki = make_pki(tmp_path / "pki")
    port = free_port()
    daemons(
        "--tcp", f"127.0.0.1:{port}", "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
        "--tls-client-ca", str(pki.ca), "--tokens-file", str(tokens_file),
    )
    target = f"localhost:{port}"
    mutual = TLSConfig.from_files(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
    round_trip(clients(target, tls=mutual, token=TOKEN_A, map_arena=False), "tenant-a", seed=33)

    # Without a client certificate the handshake fails: the call never reaches the service.
    server_only = TLSConfig.from_files(ca=pki.ca)
    with pytest.raises(Unavailable):
        clients(target, tls=server_only, token=TOKEN_A, backoff=QUICK).stats()
    # A daemon certificate from another CA is not trusted.
    stranger = make_pki(tmp_path / "other")
    untrusted = TLSConfig.from_files(ca=stranger.ca, cert=pki.client_cert, key=pki.client_key)
    with pytest.raises(Unavailable):
        clients(target, tls=untrusted, token=TOKEN_A, backoff=QUICK).stats()


def test_tls_options_are_checked_before_connecting(tmp_path):
    with pytest.raises(ValueError, match="both"):
        TLSConfig(certificate_chain=b"cert")
    with pytest.raises(ValueError, match="unix socket"):
        KVTierClient(f"unix://{tmp_path}/x.sock", tls=TLSConfig())


def test_plaintext_client_against_tls_daemon_fails_typed(daemons, clients, tmp_path, tokens_file):
    pki = make_pki(tmp_path / "pki")
    port = free_port()
    daemons("--tcp", f"127.0.0.1:{port}", "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
            "--tokens-file", str(tokens_file))
    with pytest.raises(KVTierError):
        clients(f"127.0.0.1:{port}", insecure=True, token=TOKEN_A, backoff=QUICK).stats()
    round_trip(clients(f"localhost:{port}", tls=TLSConfig.from_files(ca=pki.ca), token=TOKEN_A, map_arena=False),
               "tenant-a", seed=34)
