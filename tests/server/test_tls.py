"""TCP: TLS, mutual TLS, and --insecure plaintext, against real daemons and certificates made
here with `cryptography` (a CA, a server certificate for 127.0.0.1/localhost, a client one)."""
from __future__ import annotations

import datetime
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import keys, run_kvtier

TOKEN = "tls-token-5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _cert(subject: str, key, issuer_cert, issuer_key, *, ca: bool = False, san=None, usage=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_cert.subject if issuer_cert else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False), critical=True)
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: bytes
    client_key: bytes

    def credentials(self, *, client: bool = False) -> grpc.ChannelCredentials:
        ca = self.ca.read_bytes()
        if client:
            return grpc.ssl_channel_credentials(root_certificates=ca, private_key=self.client_key, certificate_chain=self.client_cert)
        return grpc.ssl_channel_credentials(root_certificates=ca)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("kvtier test CA", ca_key, None, None, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _cert("kvtier daemon", server_key, ca, ca_key, usage=ExtendedKeyUsageOID.SERVER_AUTH,
                   san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _cert("kvtier engine", client_key, ca, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    pem = serialization.Encoding.PEM
    (d / "ca.pem").write_bytes(ca.public_bytes(pem))
    (d / "server.pem").write_bytes(server.public_bytes(pem))
    (d / "server.key").write_bytes(_pem_key(server_key))
    (d / "tokens.toml").write_text(f'[tokens]\n"{TOKEN}" = ["*"]\n')
    return Pki(d / "ca.pem", d / "server.pem", d / "server.key", client.public_bytes(pem), _pem_key(client_key))


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
    round_trip(connect(address, token=TOKEN, credentials=pki.credentials()))
    # The certificate names localhost too.
    localhost = address.replace("127.0.0.1", "localhost")
    assert connect(localhost, token=TOKEN, credentials=pki.credentials()).state().sessions >= 1
    # A plaintext client gets no answer from the TLS port.
    assert refused(connect(address, token=TOKEN)) == grpc.StatusCode.UNAVAILABLE
    # kvtier stats over TLS, verifying the daemon against the CA.
    out = run_kvtier("stats", "--target", address, "--tls-ca", str(pki.ca), "--token", TOKEN)
    assert out.returncode == 0, out.stderr
    assert "host" in out.stdout and "disk" in out.stdout


def test_mutual_tls(daemons, connect, pki):
    d, address = tls_daemon(daemons, pki, "--tls-client-ca", str(pki.ca), name="mtls")
    assert refused(connect(address, token=TOKEN, credentials=pki.credentials())) == grpc.StatusCode.UNAVAILABLE
    round_trip(connect(address, token=TOKEN, credentials=pki.credentials(client=True)))
    # The operator commands present a client certificate too.
    cert, key = pki.ca.parent / "client.pem", pki.ca.parent / "client.key"
    cert.write_bytes(pki.client_cert)
    key.write_bytes(pki.client_key)
    without = run_kvtier("health-check", "--target", address, "--tls-ca", str(pki.ca))
    assert without.returncode == 1
    with_cert = run_kvtier("health-check", "--target", address, "--tls-ca", str(pki.ca), "--tls-cert", str(cert), "--tls-key", str(key))
    assert with_cert.returncode == 0 and "SERVING" in with_cert.stdout, with_cert.stderr


def test_insecure_tcp(daemons, connect):
    port = free_port()
    d = daemons.start("--tcp", f"127.0.0.1:{port}", "--insecure", name="plain")
    round_trip(connect(f"127.0.0.1:{port}"))
    assert "plaintext TCP" in d.log()
