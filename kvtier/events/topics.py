"""Which ZMQ topics a namespace's events go out under: the routers' names for the engines
that use the namespace (docs/events.md, "Topics").

llm-d credits an event to the endpoint named in its topic, `kv@<pod ip>:<port>@<model>`, and
hashes the model name into its request keys: the topic must name the engine's serving
endpoint and served model exactly, or the pages land on an endpoint no request matches.
Who the engine is depends on the deployment:

- a per-pod sidecar serves one engine, its own pod's: the daemon's identity (`pod_ip`,
  `engine_port`, `node_name`: the Downward API in Kubernetes) names it;
- a node-wide daemon serves every engine on its node: each engine tells its endpoint and
  served model when it registers (`EngineIdentity`), and a namespace's events go out under
  the topic of every engine attached to it, so each is credited with the pages it can read.
  A namespace no engine has named an endpoint for goes out under the daemon's identity.

The cluster tier is shared by every daemon, not one pod's: its copies go out once, under
`cluster_topic` (default llm-d's shared-storage pseudo-pod `kv@SHARED_STORAGE@<model>`).
"""
from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_TOPIC = "kv@{pod_ip}:{port}@{model}"
DEFAULT_CLUSTER_TOPIC = "kv@SHARED_STORAGE@{model}"
#: Placeholders a template may use.
FIELDS = ("host", "node", "pod_ip", "port", "model", "namespace")
#: vLLM's serving port: llm-d keys endpoints by it.
DEFAULT_ENGINE_PORT = 8000


@dataclass(frozen=True)
class EngineIdentity:
    """An engine as routers name it: its serving endpoint (`ip:port`; "" for the engine in
    the daemon's own pod, named by `pod_ip` and `engine_port`) and served model name ("" when
    it named none: the namespace's model is used)."""

    endpoint: str
    model: str = ""

    @classmethod
    def parse(cls, endpoint: str, model: str = "") -> EngineIdentity:
        """Raises ValueError saying how to write an endpoint. An empty endpoint with a model
        is the engine in the daemon's own pod, naming its model."""
        host, sep, port = endpoint.rpartition(":")
        valid = sep and host and port.isdigit() and 0 < int(port) < 65536 and "@" not in endpoint
        if endpoint and not valid:
            raise ValueError(f"engine endpoint {endpoint!r} is not IP:PORT (e.g. 10.0.3.7:8000, the address routers "
                             "send requests to)")
        if "@" in model or not model.isprintable():
            raise ValueError(f"served model name {model!r} cannot go in a topic: it holds '@' or unprintable characters")
        return cls(endpoint, model)

    @property
    def address(self) -> tuple[str, str]:
        host, _, port = self.endpoint.rpartition(":")
        return host, port


@dataclass(frozen=True)
class DaemonIdentity:
    """The daemon's own names: its pod's IP, the engine port in that pod, its node and host."""

    pod_ip: str
    engine_port: int = DEFAULT_ENGINE_PORT
    node: str = ""
    host: str = ""

    @classmethod
    def local(cls, pod_ip: str = "", engine_port: int = DEFAULT_ENGINE_PORT, node: str = "") -> DaemonIdentity:
        """Fill what was not given from the host: its name, and the address it resolves to."""
        host = socket.gethostname()
        if not pod_ip:
            try:
                pod_ip = socket.gethostbyname(host)
            except OSError:
                pod_ip = "127.0.0.1"
        return cls(pod_ip, engine_port, node or host, host)


def parse_models(text: str) -> dict[str, str]:
    """`ns=model,ns2=model2`: the served model name of each namespace's engines."""
    models = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        namespace, sep, model = entry.partition("=")
        if not sep or not namespace.strip() or not model.strip() or "@" in model:
            raise ValueError(f"cannot read {entry!r} as NAMESPACE=MODEL (a served model name without '@'); "
                             "write e.g. vllm/llama=meta-llama/Llama-3.1-8B")
        models[namespace.strip()] = model.strip()
    return models


def check_template(template: str, what: str) -> None:
    try:
        template.format(**dict.fromkeys(FIELDS, "x"))
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"{what} {template!r} is not a template of {', '.join('{' + f + '}' for f in FIELDS)} "
                         f"({exc}); e.g. {DEFAULT_TOPIC!r}") from None


class Topics:
    """Renders topics. `models`: each namespace's served model name, where engines do not
    tell theirs (the namespace itself otherwise)."""

    def __init__(self, template: str = DEFAULT_TOPIC, cluster_template: str = DEFAULT_CLUSTER_TOPIC, *,
                 identity: DaemonIdentity | None = None, models: dict[str, str] | None = None) -> None:
        check_template(template, "events topic")
        check_template(cluster_template, "cluster events topic")
        self.template = template
        self.cluster_template = cluster_template
        self.identity = identity or DaemonIdentity.local()
        self.models = models or {}

    def model(self, namespace: str, engines: Iterable[EngineIdentity] = ()) -> str:
        named = sorted({e.model for e in engines if e.model})
        return named[0] if named else self.models.get(namespace, namespace)

    def engine(self, namespace: str, engine: EngineIdentity | None, engines: Iterable[EngineIdentity] = ()) -> bytes:
        """The topic crediting `engine` (None: the daemon's own pod) with a namespace's pages."""
        me = self.identity
        pod_ip, port = engine.address if engine is not None and engine.endpoint else (me.pod_ip, str(me.engine_port))
        model = engine.model if engine is not None and engine.model else self.model(namespace, engines)
        return self.template.format(host=me.host, node=me.node, pod_ip=pod_ip, port=port, model=model,
                                    namespace=namespace).encode()

    def shared(self, namespace: str, engines: Iterable[EngineIdentity] = ()) -> bytes:
        """The topic of the namespace's cluster-tier copies."""
        me = self.identity
        return self.cluster_template.format(host=me.host, node=me.node, pod_ip=me.pod_ip, port=str(me.engine_port),
                                            model=self.model(namespace, engines), namespace=namespace).encode()
