"""CurveZMQ on the KV events endpoint: the daemon's key pair, the client keys it lets in,
and the ZAP handler that checks them (docs/events.md, "Security").

A PUB socket has no authentication of its own. With CURVE the daemon is the CURVE server
whether it binds or connects, so every peer must complete a handshake with a key on the
allow-list before it gets a byte, and what it gets is encrypted. A plain (NULL) peer fails
the handshake on the mechanism; a CURVE peer whose key is not listed is refused by the ZAP
handler (pyzmq's ThreadAuthenticator, "400"). Either receives nothing. In connect mode this
authenticates the listener the daemon dials, so binding its address first gains nothing.

Keys are files in ZMQ's certificate format (czmq's zcert, `zmq.auth.create_certificates`):
the daemon's secret certificate (`<name>.key_secret`: public-key and secret-key), and a
directory of its clients' public certificates (`*.key`). They are read and checked once, at
start; a restart picks up a changed directory.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

SECRET_OPTION = "events_curve_secret_key_file"
CLIENTS_OPTION = "events_curve_clients_dir"
HOW = "make them with `python -c 'import zmq.auth; zmq.auth.create_certificates(\".\", \"kvtier\")'` (docs/events.md)"


@dataclass(frozen=True)
class CurveKeys:
    """The daemon's CURVE key pair (z85 text, 40 characters each) and its allow-list."""

    public: bytes
    secret: bytes
    clients_dir: str  # where the allowed clients' public certificates (*.key) are
    clients: tuple[bytes, ...]  # their public keys, as the ZAP handler will compare them


def _key(text: bytes | None, what: str) -> bytes:
    """`text` if it is a CURVE key in z85 (40 characters, 32 bytes)."""
    try:
        if text is not None and len(z85.decode(text)) == 32:
            return text
    except (ValueError, KeyError, TypeError):  # z85.decode: a wrong length, a character outside z85
        pass
    raise ValueError(f"{what} is not a CURVE key (40 characters of z85); {HOW}")


def _certificate(path: Path, what: str) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError:
        raise ValueError(f"{what} {path} cannot be read (missing?); {HOW}") from None
    except ValueError:
        raise ValueError(f"{what} {path} holds no public-key line: it is not a ZMQ certificate; {HOW}") from None
    return _key(public, f"{what} {path}: its public-key"), secret


def load_curve(secret_key_file: str, clients_dir: str) -> CurveKeys | None:
    """The keys the two options name; None when neither is set. Raises ValueError naming the
    option and the file when one is missing, unreadable or not a ZMQ certificate."""
    if not secret_key_file and not clients_dir:
        return None
    if not zmq.has("curve"):
        raise ValueError(f"{SECRET_OPTION}: this pyzmq's libzmq {zmq.zmq_version()} was built without CURVE "
                         "(libsodium); install a pyzmq wheel that has it (zmq.has('curve'))")
    if not secret_key_file:
        raise ValueError(f"{CLIENTS_OPTION} needs {SECRET_OPTION}: the daemon's own secret certificate")
    if not clients_dir:
        raise ValueError(f"{SECRET_OPTION} needs {CLIENTS_OPTION}: without an allow-list any client that knows the "
                         "daemon's public key would read the events")
    public, secret = _certificate(Path(secret_key_file), SECRET_OPTION)
    if secret is None:
        raise ValueError(f"{SECRET_OPTION} {secret_key_file} holds a public key only; give the secret certificate "
                         "(the .key_secret file)")
    secret = _key(secret, f"{SECRET_OPTION} {secret_key_file}: its secret-key")
    if zmq.curve_public(secret) != public:
        raise ValueError(f"{SECRET_OPTION} {secret_key_file}: its public-key is not the one of its secret-key")
    if os.stat(secret_key_file).st_mode & 0o077:
        log.warning("KV events: the CURVE secret key file is readable by other users; chmod 600 it",
                    extra={"path": secret_key_file})
    directory = Path(clients_dir)
    if not directory.is_dir():
        raise ValueError(f"{CLIENTS_OPTION} {clients_dir} is not a directory of client certificates (*.key)")
    files = sorted(directory.glob("*.key"))
    if not files:
        raise ValueError(f"{CLIENTS_OPTION} {clients_dir} holds no client certificate (*.key): no one could "
                         "subscribe; put each router's public certificate there")
    clients = tuple(_certificate(path, CLIENTS_OPTION)[0] for path in files)
    return CurveKeys(public, secret, str(directory.resolve()), clients)  # absolute: "*" would mean any key to the handler


def serve_curve(context: zmq.Context, socket: zmq.Socket, keys: CurveKeys) -> ThreadAuthenticator:
    """Make `socket` (not yet bound or connected) a CURVE server that lets in `keys.clients`
    only; returns the running ZAP handler, to stop before the context ends."""
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve(domain="*", location=keys.clients_dir)
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True
    log.info("KV events: CurveZMQ on", extra={"clients": len(keys.clients), "clients_dir": keys.clients_dir})
    return authenticator
