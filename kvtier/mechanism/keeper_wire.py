"""The arena keeper's messages (kvtier.mechanism.keeper): one JSON object per SOCK_SEQPACKET
message, at most one descriptor with it, and the one parse step that turns a peer's bytes
into a typed `Request`, or refuses them.

Any process of the daemon's uid may connect to the keeper, so nothing here trusts the peer:
a message is whole or refused (SOCK_SEQPACKET never splits one; the kernel cuts a longer one
and says so), every field has its type and bound, and the caller closes any descriptor that
came with a message that wants none.

    {"op": "list", "hold": bool, "owner": str}
                                            -> {"name", "meta"} + fd per entry, then {"end": true}
    {"op": "keep", "name", "meta"} + fd        hold it (replacing one of that name)
    {"op": "drop", "name"}                     close it
    {"op": "clear"}                            close all, then hang up (a daemon's clean stop)
    {"op": "status"}                        -> {"files": int, "held": bool} (a probe)
    {"op": "exit"}                             close all and exit (a standalone keeper refuses it)
    a refused request                       -> {"error": "what was wrong"}, then the keeper hangs up

`hold` is what a daemon sends: it makes the connection the daemon's (kept open; its hang-up
starts the keeper's linger). `owner` names the daemon (its socket path): a keeper keeps one
daemon's files, and frees them rather than hand them to a daemon of another socket. A keeper
from before `hold` answers the `list` all the same.
"""
from __future__ import annotations

import array
import enum
import fcntl
import json
import os
import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: The longest message either side sends or takes; the kernel cuts a longer one (MSG_TRUNC).
MESSAGE_BYTES = 64 * 1024
#: A kept file's name: "<layout id>/slots" or "<layout id>/ns/<namespace>" (a namespace is
#: at most 255 bytes, kvtier.mechanism.slottable).
NAME_CHARS = 512
#: A kept file's meta (a layout, or a namespace's name: 255 bytes, escaped), as JSON.
META_BYTES = 2048
#: A daemon's name for itself (its socket path: PATH_MAX).
OWNER_CHARS = 4096

_FD_ROOM = socket.CMSG_SPACE(array.array("i").itemsize)  # one descriptor (the kernel fits two)


class Op(enum.Enum):
    LIST = "list"
    KEEP = "keep"
    DROP = "drop"
    CLEAR = "clear"
    STATUS = "status"
    EXIT = "exit"


#: The fields each request may carry besides "op", and which of them it must.
_FIELDS: dict[Op, tuple[frozenset[str], frozenset[str]]] = {
    Op.LIST: (frozenset({"hold", "owner"}), frozenset()),
    Op.KEEP: (frozenset({"name", "meta"}), frozenset({"name", "meta"})),
    Op.DROP: (frozenset({"name"}), frozenset({"name"})),
    Op.CLEAR: (frozenset(), frozenset()),
    Op.STATUS: (frozenset(), frozenset()),
    Op.EXIT: (frozenset(), frozenset()),
}


class BadMessage(ValueError):
    """A message that is not a request the keeper understands; its text says why."""


@dataclass(frozen=True)
class Request:
    """A checked request. `fd` (keep only) is the receiver's to hold or close."""

    op: Op
    name: str = ""
    meta: dict | None = None
    hold: bool = False
    owner: str = ""  # list: the daemon that holds ("" = unnamed)
    fd: int | None = None


@dataclass
class KeptFile:
    """A descriptor the keeper held for us, with what the daemon said it was."""

    name: str
    meta: dict
    fd: int


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "…"


def _name(message: dict) -> str:
    name = message["name"]
    if not isinstance(name, str) or not 0 < len(name) <= NAME_CHARS:
        raise BadMessage(f"name must be a string of 1 to {NAME_CHARS} characters, not {_show(name)}")
    return name


def _is_memory(fd: int) -> bool:
    """A memfd (or another shared-memory file): what a daemon maps; a socket, pipe or
    device would fail (or block) its successor instead."""
    try:
        fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False
    return True


def _meta(meta: object) -> dict:
    try:
        small = isinstance(meta, dict) and len(json.dumps(meta)) <= META_BYTES
    except (ValueError, RecursionError):
        small = False
    if not small:
        raise BadMessage(f"meta must be an object of at most {META_BYTES} bytes as JSON")
    return meta


def parse_request(data: bytes, fds: list[int], flags: int) -> Request:
    """The request in one received message, or BadMessage. Never closes `fds`: the caller
    closes them on BadMessage, and all but a keep's one otherwise (none are left)."""
    if flags & socket.MSG_TRUNC:
        raise BadMessage(f"message longer than {MESSAGE_BYTES} bytes")
    if flags & socket.MSG_CTRUNC or len(fds) > 1:
        raise BadMessage("more than one descriptor with a message")
    try:
        message = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser goes
        raise BadMessage(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(message, dict):
        raise BadMessage(f"a JSON {type(message).__name__}, not an object")
    raw_op = message.get("op")
    op = next((o for o in Op if o.value == raw_op), None)
    if op is None:
        raise BadMessage(f"unknown op {_show(raw_op)}; known: {', '.join(o.value for o in Op)}")
    allowed, required = _FIELDS[op]
    fields = set(message) - {"op"}
    if fields - allowed or required - fields:
        raise BadMessage(f"{op.value} takes {sorted(allowed) or 'no fields'}, got {_show(sorted(fields))}")
    if (op is Op.KEEP) != bool(fds):
        raise BadMessage("keep takes exactly one descriptor" if op is Op.KEEP else f"{op.value} takes no descriptor")
    if op is Op.KEEP:
        if not _is_memory(fds[0]):
            raise BadMessage("keep takes a memory file (memfd), not a descriptor of another kind")
        return Request(op, _name(message), _meta(message["meta"]), fd=fds[0])
    if op is Op.DROP:
        return Request(op, _name(message))
    if op is not Op.LIST:
        return Request(op)
    hold, owner = message.get("hold", False), message.get("owner", "")
    if not isinstance(hold, bool):
        raise BadMessage(f"hold must be true or false, not {_show(hold)}")
    if not isinstance(owner, str) or len(owner) > OWNER_CHARS:
        raise BadMessage(f"owner must be a string of at most {OWNER_CHARS} characters, not {_show(owner)}")
    return Request(op, hold=hold, owner=owner)


def parse_entry(data: bytes, fds: list[int]) -> KeptFile | None:
    """One message of the keeper's answer to `list`: a kept file, or None at its end.
    ValueError (the caller closes `fds`) if it is neither, or the keeper's own error."""
    try:
        message = json.loads(data) if data else None
    except RecursionError:
        message = None
    if isinstance(message, dict) and message.get("end") is True and not fds:
        return None
    if isinstance(message, dict) and isinstance(message.get("error"), str):
        raise ValueError(f"it refused: {message['error']}")
    if (not isinstance(message, dict) or not isinstance(message.get("name"), str)
            or not isinstance(message.get("meta"), dict) or len(fds) != 1):
        raise ValueError(f"an answer that is not a kept file: {_show(message)}")
    return KeptFile(message["name"], message["meta"], fds[0])


def send(sock: socket.socket, message: dict, fd: int | None = None) -> None:
    data = json.dumps(message).encode()
    if fd is None:
        sock.sendmsg([data])
    else:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def receive(sock: socket.socket) -> tuple[bytes, list[int], int]:
    """One message, the descriptors that came with it (the caller's to close) and its flags
    (MSG_TRUNC: it was longer; MSG_CTRUNC: more descriptors came than fit, the kernel closed
    them). An empty message and no descriptors: the peer hung up."""
    data, ancillary, flags, _ = sock.recvmsg(MESSAGE_BYTES, _FD_ROOM)
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds), flags


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


@contextmanager
def socket_address(path: str) -> Iterator[str]:
    """A name for `path` that fits a Unix socket address (107 bytes) however deep its
    directory: /proc/self/fd/<the directory's descriptor>/<file name>."""
    directory = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{directory}/{os.path.basename(path)}"
    finally:
        os.close(directory)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket, from the kernel."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)
