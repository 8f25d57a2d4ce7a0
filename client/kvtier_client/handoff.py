"""Attaching a session over the daemon's handoff socket: the client side.

A same-host client registers over gRPC, then connects to the handoff socket the daemon
named (SOCK_SEQPACKET) and asks for its session. The kernel tells the daemon which
process is asking (SO_PEERCRED); the daemon binds the session to it and answers with the
session key and, as an SCM_RIGHTS descriptor, its namespace's host arena. Nothing else
can get either: a session id read from a log is of no use to another process.

    client -> {"session_id", "token"}
    daemon -> {"ok": true, "session_key", "arena_bytes"} + the arena's descriptor
              {"ok": false, "code", "message"}                 (a KVTierError code)

A daemon whose device tier has memory per namespace adds ``"device": {"pages", "stride",
"pci_bus_id"}`` and a second descriptor, the namespace's device slot table
(kvtier_client.device_plan). The attached process then asks for the descriptors of its
namespace's device slots, as many connections as it needs (at most MAX_SLOTS_PER_REQUEST
slots each):

    client -> {"session_id", "token", "device_slots": [slot, ...]}
    daemon -> {"ok": true, "device_slots": [[slot, generation], ...]} + one descriptor per
              listed slot, in order (only slots the namespace holds are listed)
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

from kvtier_client.errors import ERRORS_BY_CODE, KVTierError, Unavailable
from kvtier_client.seqpacket import connect

MESSAGE_BYTES = 64 * 1024


@dataclass(frozen=True)
class DeviceGrant:
    """A namespace's device memory as attaching gave it: the slot table's descriptor (the
    caller owns it) and the arena's shape."""

    table_fd: int
    pages: int
    stride: int
    pci_bus_id: str


@dataclass(frozen=True)
class Attachment:
    """What attaching gave: the key every call of the session carries, and the arena (the
    caller owns the descriptors)."""

    session_key: str
    arena_fd: int
    arena_bytes: int
    device: DeviceGrant | None = None  # a device tier with memory per namespace


def _exchange(path: str, request: dict, max_fds: int, timeout: float, what: str) -> tuple[dict, list[int]]:
    """One request and its reply with its descriptors (the caller owns them once returned)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        try:
            connect(sock, path, timeout)
            sock.sendall(json.dumps(request).encode())
            data, fds, flags, _ = socket.recv_fds(sock, MESSAGE_BYTES, max_fds)
        except OSError as exc:
            raise Unavailable(f"cannot {what} at the daemon's handoff socket {path} ({exc})") from exc
    try:
        if flags & socket.MSG_CTRUNC:
            raise KVTierError(f"the daemon's {what} answer carried more descriptors than asked for; daemon and client disagree")
        reply = json.loads(data) if data else {"ok": False, "code": "UNAVAILABLE", "message": "the daemon hung up"}
        if not reply.get("ok"):
            raise ERRORS_BY_CODE.get(reply.get("code"), KVTierError)(f"{what} refused: {reply.get('message')}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return reply, fds


def attach(path: str, session_id: str, token: str | None, *, timeout: float = 10.0) -> Attachment:
    """Attach `session_id` to this process; raises the daemon's KVTierError on refusal."""
    reply, fds = _exchange(path, {"session_id": session_id, "token": token}, 2, timeout, "attach the session")
    try:
        device = reply.get("device")
        if len(fds) != (2 if device else 1):
            raise KVTierError("the daemon's attach answer carried the wrong number of descriptors; daemon and client disagree")
        grant = None
        if device:
            grant = DeviceGrant(fds[1], int(device["pages"]), int(device["stride"]), str(device["pci_bus_id"]))
        attachment = Attachment(reply["session_key"], fds[0], int(reply["arena_bytes"]), grant)
        fds.clear()
        return attachment
    finally:
        for fd in fds:
            os.close(fd)


def fetch_device_slots(path: str, session_id: str, token: str | None, slots: list[int], *,
                       timeout: float = 10.0) -> list[tuple[int, int, int]]:
    """(slot, generation, descriptor) of each of `slots` the session's namespace holds (the
    caller owns the descriptors). Only the process the session is attached to may ask."""
    request = {"session_id": session_id, "token": token, "device_slots": slots}
    reply, fds = _exchange(path, request, len(slots), timeout, "map device slots")
    try:
        listed = reply.get("device_slots")
        if not isinstance(listed, list) or len(listed) != len(fds):
            raise KVTierError("the daemon's device answer lists other slots than it sent descriptors for; "
                              "daemon and client disagree")
        granted = [(int(slot), int(generation), fd) for (slot, generation), fd in zip(listed, fds)]
        fds.clear()
        return granted
    finally:
        for fd in fds:
            os.close(fd)
