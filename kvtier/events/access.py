"""Who the ZMQ endpoint of KV events talks to, and what it tells them (docs/events.md,
"Security"). Token ids are prompts, so the network endpoint is held to three rules:

- **bind only, unless told.** An endpoint without a wildcard is dialled out to (vLLM's rule),
  and whoever listens at that address first gets every published prompt. The daemon does it
  only with `events_connect` set; otherwise it refuses to start, naming the option.
- **namespaces on a list.** `events_namespaces` names the namespaces whose events go out
  (`*`: all). WatchEvents is not affected: it shows each token its own namespaces. With
  tokens (a multi-tenant daemon) the list must be given: no tenant's prompts leave the node
  unless the operator named it. There is one list per endpoint, not per subscriber: a PUB
  socket sends each message to every peer subscribed to a prefix of its topic, and the
  subscriber picks the prefix, so the daemon cannot hold one peer to some namespaces (one
  tenant's stream per subscriber is what WatchEvents is for).
- **CurveZMQ, optional.** With the two key options the endpoint lets in only listed
  client keys, encrypted (kvtier.events.curve).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvtier.events.curve import CurveKeys, load_curve

NAMESPACES_OPTION = "events_namespaces"
CONNECT_OPTION = "events_connect"


class AccessOptions(Protocol):
    """What the endpoint's access is made from: the daemon's events options
    (kvtier.server.config.EventsConfig has these fields; events never imports the server)."""

    namespaces: str
    connect: bool
    curve_secret_key_file: str
    curve_clients_dir: str


@dataclass(frozen=True)
class EndpointAccess:
    """`namespaces`: those published on ZMQ (None: every one). `connect`: dialling out is
    allowed. `curve`: the CURVE keys (None: plain ZMQ, readable by any peer that reaches it)."""

    namespaces: frozenset[str] | None = None
    connect: bool = False
    curve: CurveKeys | None = None

    def publishes(self, namespace: str) -> bool:
        return self.namespaces is None or namespace in self.namespaces

    @classmethod
    def configured(cls, events: AccessOptions, *, tenants: bool) -> EndpointAccess:
        """The access the events options give; `tenants`: namespaces are authorised (tokens),
        so the namespace list must be given. Raises ValueError naming the option to fix."""
        if events.namespaces == "" and tenants:
            raise ValueError(f"with tokens (auth = tokens) the ZMQ endpoint would carry every tenant's token ids; "
                             f"name the namespaces whose events may leave the node in {NAMESPACES_OPTION} "
                             f"(--events-namespaces a,b), or * for all")
        return cls(parse_namespaces(events.namespaces or "*"), events.connect,
                   load_curve(events.curve_secret_key_file, events.curve_clients_dir))


def parse_namespaces(text: str) -> frozenset[str] | None:
    """`a,b,c` -> those names; `*` -> None (all)."""
    if text.startswith("[") and text.endswith("]"):
        raise ValueError(f"{NAMESPACES_OPTION}: write the names comma-separated in one string (\"a,b\"), not {text}")
    names = [name.strip() for name in text.split(",")]
    if "*" in names:
        if len(names) > 1:
            raise ValueError(f"{NAMESPACES_OPTION}: {text!r} mixes * (every namespace) with names; give one or the other")
        return None
    if not all(names):
        raise ValueError(f"{NAMESPACES_OPTION}: {text!r} has an empty name; write e.g. model-a,model-b")
    return frozenset(names)


def connect_refusal(endpoint: str) -> str:
    """Why a connect-mode endpoint is refused without `events_connect`."""
    return (f"{endpoint!r} has no wildcard, so the daemon would connect to it and send the published namespaces' "
            f"token ids (prompts) to whoever listens there; set {CONNECT_OPTION} = true (--events-connect) if that "
            "listener is yours (with CurveZMQ it must also hold a listed key), or bind instead, e.g. tcp://*:5557")
