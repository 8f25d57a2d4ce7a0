"""Identifier types shared by the client and the daemon.

NewTypes, as `BlockKey` in `kvtier_client.keys`: free at run time, but a type checker
then catches a slot passed where a lease id is expected, or a session id logged as a
namespace. The daemon imports these same names, so one id means one thing on both sides.
"""
from __future__ import annotations

from typing import NewType

#: A session's id: 32 hex characters from the daemon's Register reply. A credential:
#: log `short_session(id)`, never the whole id.
SessionId = NewType("SessionId", str)

#: A lease's id, unique within its pool for the daemon's lifetime (never reused).
LeaseId = NewType("LeaseId", int)

#: A page's index in its tier's arena: page `s` lives at byte `s * slot_bytes`.
Slot = NewType("Slot", int)


def short_session(session_id: str) -> str:
    """The first 8 characters of a session id: enough to follow one in logs, too few to use."""
    return session_id[:8]
