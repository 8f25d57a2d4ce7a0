"""TCP: TLS, mutual TLS, and --insecure plaintext, against real daemons and certificates made
here with `cryptography` (a CA, a server certificate for 127.0.0.1/localhost, a client one)."""
from __future__ import annotations

import socket

import grpc
import pytest
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from pki import Pki, make_pki
from rpc import keys, run_kvtier

TOKEN = "tls-token-5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def credentials(pki: Pki, *, client: bool = False) -> grpc.ChannelCredentials:
    ca = pki.ca.read_bytes()
    if client:
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=pki.client_key.read_bytes(), certificate_chain=pki.client_cert.read_bytes()
        )
    return grpc.ssl_channel_credentials(root_certificates=ca)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    made = make_pki(tmp_path_factory.mktemp("pki"))
    (made.ca.parent / "tokens.toml").write_text(f'[tokens]\n"{TOKEN}" = ["*"]\n')
    return made


def tls_daemon(daemons, pki: Pki, *extra: str, name: str):
    port = free_port()
    d = daemons.start("--tcp", f"127.0.0.1:{port}", "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                      "--tokens-file", str(pki.ca.parent / "tokens.toml"), *extra, name=name)
    return d, f"127.0.0.1:{port}"


def round_trip(conn) -> None:
    """Register, Borrow, Commit, Lookup: the whole write path and a hit."""
    s = conn.session("over-tcp")
    blocks = keys("tcp", 3)
    lease = s.borrow(3)
    assert s.commit(lease.lease_id, blocks).committed == 3
    assert s.lookup(blocks).hit_blocks == 3


def refused(conn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        conn.call("Register", pb.RegisterRequest(), timeout=5)
    return info.value.code()


def test_tls(daemons, connect, pki):
    d, address = tls_daemon(daemons, pki, name="tls")
    round_trip(connect(address, token=TOKEN, credentials=credentials(pki)))
    # The certificate names localhost too.
    localhost = address.replace("127.0.0.1", "localhost")
    assert connect(localhost, token=TOKEN, credentials=credentials(pki)).state().sessions >= 1
    # A plaintext client gets no answer from the TLS port.
    assert refused(connect(address, token=TOKEN)) == grpc.StatusCode.UNAVAILABLE
    # kvtier stats over TLS, verifying the daemon against the CA.
    out = run_kvtier("stats", "--target", address, "--tls-ca", str(pki.ca), "--token", TOKEN)
    assert out.returncode == 0, out.stderr
    assert "host" in out.stdout and "disk" in out.stdout


def test_mutual_tls(daemons, connect, pki):
    d, address = tls_daemon(daemons, pki, "--tls-client-ca", str(pki.ca), name="mtls")
    assert refused(connect(address, token=TOKEN, credentials=credentials(pki))) == grpc.StatusCode.UNAVAILABLE
    round_trip(connect(address, token=TOKEN, credentials=credentials(pki, client=True)))
    # The operator commands present a client certificate too.
    cert, key = pki.client_cert, pki.client_key
    without = run_kvtier("health-check", "--target", address, "--tls-ca", str(pki.ca))
    assert without.returncode == 1
    with_cert = run_kvtier("health-check", "--target", address, "--tls-ca", str(pki.ca), "--tls-cert", str(cert), "--tls-key", str(key))
    assert with_cert.returncode == 0 and "SERVING" in with_cert.stdout, with_cert.stderr


def test_insecure_tcp(daemons, connect):
    port = free_port()
    d = daemons.start("--tcp", f"127.0.0.1:{port}", "--insecure", name="plain")
    round_trip(connect(f"127.0.0.1:{port}"))
    assert "plaintext TCP" in d.log()
