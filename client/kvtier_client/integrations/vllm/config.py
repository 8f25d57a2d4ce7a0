"""The connector's settings: `kv_connector_extra_config` checked into a `ConnectorConfig`,
and the namespace vLLM's own configuration implies (the page layout and the parallel shape
are kvtier_client.integrations.vllm.shapes').

Every key is listed in the package docstring and in docs/integrations.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier_client.client import KVTierClient
from kvtier_client.connection import Backoff, TLSConfig
from kvtier_client.integrations.daemon_settings import default_target, resolve_token

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: kv_connector_extra_config keys this connector reads.
CONFIG_KEYS = (
    "target", "namespace", "salt", "token", "token_file", "tls_ca", "tls_cert", "tls_key", "tls_server_name",
    "insecure", "planner", "prefetch", "connect_timeout", "kv_cache_format", "async_loads", "max_load_tokens",
    "on_reset", "page_tokens", "kv_events_pages",
)
#: How a layer's KV tensor holds K and V (kvtier_client.integrations.vllm.worker).
KV_CACHE_FORMATS = ("auto", "cpu", "kv_last_dim")
#: When a load runs in the background (vLLM's asynchronous external hits: the request waits,
#: the others' steps go on): "auto" when a page must come from disk or the cluster (or the
#: model has several KV cache groups, whose load failures vLLM takes only per request),
#: "always", or "never" (loads run before the step's forward pass).
ASYNC_LOADS = ("auto", "always", "never")
#: What vLLM's cache reset (after a weight update, on pause with clear_cache, before sleep)
#: does to the keys this engine reads: "new_epoch" (pages stored before are not read again:
#: they may hold KV of other weights) or "keep" (for engines that sleep and reset without
#: ever changing weights in memory: their pages stay hits across sleep).
ON_RESET = ("new_epoch", "keep")


def _as_bool(extra: dict[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ValueError(f"kvtier connector: kv_connector_extra_config[{key!r}] must be true or false, got {value!r}")


def _as_str(extra: dict[str, Any], key: str, default: str | None = None) -> str | None:
    value = extra.get(key, default)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"kvtier connector: kv_connector_extra_config[{key!r}] must be a string, got {value!r}")
    return value


def _as_choice(extra: dict[str, Any], key: str, choices: tuple[str, ...]) -> str:
    """A string key that must be one of `choices` (the first is the default)."""
    value = _as_str(extra, key, choices[0])
    if value not in choices:
        raise ValueError(f"kvtier connector: {key} must be one of {choices}, got {value!r}")
    return value


def _as_count(extra: dict[str, Any], key: str, default: int) -> int:
    """A whole number >= 1 (`default` when the key is absent)."""
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"kvtier connector: {key} must be a whole number >= 1, got {value!r}")
    return value


def _as_tokens(extra: dict[str, Any], key: str, minimum: int) -> int | None:
    """An optional whole number of tokens >= `minimum` (None when the key is absent)."""
    value = extra.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ValueError(f"kvtier connector: {key} must be a whole number of tokens >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class ConnectorConfig:
    """What `kv_connector_extra_config` asked for, checked (see the package docstring)."""

    target: str
    namespace: str
    salt: bytes = b""
    token: str | None = field(default=None, repr=False)
    tls: TLSConfig | None = field(default=None, repr=False)
    insecure: bool = False
    use_planner: bool = True
    prefetch: bool = True
    connect_timeout: float = 10.0
    kv_cache_format: str = "auto"
    async_loads: str = "auto"
    max_load_tokens: int | None = None  # at most this many tokens loaded per request (None: no limit)
    on_reset: str = "new_epoch"
    page_tokens: int | None = None  # tokens per kvtier page: a multiple of vLLM's block size (None: one block)
    kv_events_pages: int = 1_000_000  # pages whose tier changes are relayed as KV events, at most (tier_events.py)
    served_model: str = ""  # vLLM's served model name: the daemon names its KV event topics with it

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, *, default_namespace: str,
                   served_model: str = "") -> ConnectorConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(CONFIG_KEYS))
        if unknown:
            raise ValueError(
                f"kvtier connector: unknown kv_connector_extra_config key(s) {unknown}; "
                f"the keys are {', '.join(CONFIG_KEYS)}"
            )
        target = _as_str(extra, "target") or default_target()
        if not (target.startswith("unix://") or (":" in target and "/" not in target)):
            raise ValueError(
                f"kvtier connector: target {target!r} is neither 'unix:///abs/path.sock' nor 'host:port'"
            )
        namespace = _as_str(extra, "namespace") or default_namespace
        if not namespace:
            raise ValueError("kvtier connector: namespace must be a non-empty string")
        salt = _as_str(extra, "salt", "") or ""
        token = resolve_token(_as_str(extra, "token"), _as_str(extra, "token_file"), "kvtier connector")
        tls_files = {k: _as_str(extra, k) for k in ("tls_ca", "tls_cert", "tls_key")}
        server_name = _as_str(extra, "tls_server_name")
        tls = None
        if any(tls_files.values()) or server_name:
            if target.startswith("unix://"):
                raise ValueError("kvtier connector: tls_* applies to a host:port target, not a unix socket")
            try:
                tls = TLSConfig.from_files(tls_files["tls_ca"], tls_files["tls_cert"], tls_files["tls_key"], server_name)
            except (OSError, ValueError) as exc:
                raise ValueError(f"kvtier connector: TLS configuration: {exc}") from None
        timeout = extra.get("connect_timeout", 10.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"kvtier connector: connect_timeout must be positive seconds, got {timeout!r}")
        return cls(
            target=target, namespace=namespace, salt=salt.encode(), token=token, tls=tls,
            insecure=_as_bool(extra, "insecure", False), use_planner=_as_bool(extra, "planner", True),
            prefetch=_as_bool(extra, "prefetch", True), connect_timeout=float(timeout),
            kv_cache_format=_as_choice(extra, "kv_cache_format", KV_CACHE_FORMATS),
            async_loads=_as_choice(extra, "async_loads", ASYNC_LOADS),
            max_load_tokens=_as_tokens(extra, "max_load_tokens", 0), on_reset=_as_choice(extra, "on_reset", ON_RESET),
            page_tokens=_as_tokens(extra, "page_tokens", 1),  # a multiple of vLLM's block (kv_groups checks)
            kv_events_pages=_as_count(extra, "kv_events_pages", cls.kv_events_pages), served_model=served_model,
        )

    def client(self, name: str, *, map_arena: bool = True) -> KVTierClient:
        return KVTierClient(
            self.target, token=self.token, tls=self.tls, insecure=self.insecure, name=name, map_arena=map_arena,
            backoff=Backoff(total=self.connect_timeout), timeout=max(30.0, self.connect_timeout),
            served_model=self.served_model or None,  # the engine's endpoint: $KVTIER_ENGINE_ENDPOINT (node-wide daemons)
        )


def served_model(vllm_config: VllmConfig) -> str:
    """The name requests use for the model (`--served-model-name`, else the model): routers
    such as llm-d hash it into their keys, so KV event topics must carry it exactly."""
    model = vllm_config.model_config
    served = model.served_model_name
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return str(served or model.model)


def default_namespace(vllm_config: VllmConfig) -> str:
    """`vllm/<served model name>`: the namespace when kv_connector_extra_config names none."""
    return "vllm/" + served_model(vllm_config).lstrip("/")
