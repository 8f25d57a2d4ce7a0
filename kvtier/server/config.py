"""Daemon configuration: one frozen, typed tree built from defaults < TOML file < KVTIER_*
environment variables < command-line flags (later wins). docs/configuration.md lists every key."""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, fields
from typing import Any

from kvtier.units import parse_size

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

class ConfigError(ValueError):
    """The configuration is unusable; the message says which key and how to fix it."""


def parse_seconds(text: str | float, key: str) -> float:
    """'5s', '500ms', '2', 2.5 -> seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m)?\s*", str(text))
        if not m:
            raise ConfigError(f"{key}: cannot read {text!r} as a duration; write e.g. 5s or 500ms")
        value = float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]
    if value <= 0:
        raise ConfigError(f"{key}: duration must be positive")
    return value


def default_socket() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvtier-{os.getuid()}"
    return os.path.join(runtime, "kvtier", "kvtier.sock")


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvtier")


@dataclass(frozen=True)
class DaemonConfig:
    socket: str = ""  # Unix socket path; "" = the default under $XDG_RUNTIME_DIR
    tcp: str = ""  # host:port to also listen on TCP
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""  # set = mutual TLS: clients must present a certificate it signed
    insecure: bool = False  # allow TCP without TLS (loopback testing only)
    auth: str = ""  # "tokens" or "none"; "" = tokens if a tokens file is given, else none
    tokens_file: str = ""  # TOML: [tokens] "<token>" = ["namespace", ...] ("*" = any)
    cache_dir: str = ""  # disk tier directory; "" = $XDG_CACHE_HOME/kvtier
    host_size: int = 1 << 30
    disk_size: int = 8 << 30
    device_size: int = 0  # GPU HBM per layout for the device tier; 0 = no device tier
    gpu: int = 0  # CUDA device index of the device tier
    policy: str = "lru"
    write_through: bool = False
    fsync: str = "batch"  # batch | interval | never (docs/tiers.md, "Durability")
    fsync_interval: float = 1.0  # seconds between flushes for fsync = interval
    io_depth: int = 8  # disk reads and writes in flight per pool
    max_queued_prefetch: int = 1024  # prefetch loads queued per pool; further hints are dropped
    prefetch_hold: float = 10.0  # seconds a prefetched page is kept unless acquired
    session_timeout: float = 3.0  # seconds without a heartbeat before a session's leases go
    drain_timeout: float = 10.0  # seconds SIGTERM waits for leases to be released
    metrics_port: int = 0  # 0 = no Prometheus endpoint
    metrics_host: str = "127.0.0.1"
    arena_prefix: str = ""  # host arena names; "" = derived from the socket path
    max_pools: int = 4  # distinct page layouts served at once; each gets host_size and disk_size
    log_level: str = "info"
    log_format: str = "json"

    def resolved(self) -> "DaemonConfig":
        """Fill the derived defaults and validate; raises ConfigError with a one-line reason."""
        socket = os.path.abspath(self.socket or default_socket())
        changes: dict[str, Any] = {
            "socket": socket,
            "cache_dir": os.path.abspath(self.cache_dir or _default_cache_dir()),
            "arena_prefix": self.arena_prefix or "kvtier-" + hashlib.sha256(socket.encode()).hexdigest()[:8],
            "auth": self.auth or ("tokens" if self.tokens_file else "none"),
        }
        cfg = DaemonConfig(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        if self.policy not in ("lru", "prefix"):
            raise ConfigError(f"policy: unknown {self.policy!r}; use lru or prefix")
        if self.auth not in ("tokens", "none"):
            raise ConfigError(f"auth: unknown {self.auth!r}; use tokens or none")
        if self.auth == "tokens" and not self.tokens_file:
            raise ConfigError("auth = tokens needs tokens_file (a TOML file with a [tokens] table)")
        if self.tcp:
            m = re.fullmatch(r".+:([0-9]+)", self.tcp)
            if not m or not 0 < int(m.group(1)) <= 65535:
                raise ConfigError(f"tcp: {self.tcp!r} is not host:port with a port from 1 to 65535")
            if not (self.tls_cert and self.tls_key) and not self.insecure:
                raise ConfigError("tcp needs tls_cert and tls_key, or --insecure for plaintext on a trusted loopback")
            if self.auth == "none" and not self.insecure:
                raise ConfigError("tcp with auth = none would let anyone on the network in: configure tokens_file")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key go together")
        if self.host_size <= 0:
            raise ConfigError("host_size must be positive: the host tier is where engines read and write pages")
        if self.device_size < 0 or self.gpu < 0:
            raise ConfigError("device_size and gpu must be >= 0 (device_size 0 = no device tier)")
        if self.fsync not in ("batch", "interval", "never"):
            raise ConfigError(f"fsync: unknown {self.fsync!r}; use batch, interval or never")
        if self.io_depth < 1 or self.io_depth > 256:
            raise ConfigError("io_depth must be between 1 and 256")
        if self.max_queued_prefetch < 0:
            raise ConfigError("max_queued_prefetch must be >= 0 (0 turns prefetch off)")
        if self.max_pools < 1:
            raise ConfigError("max_pools must be at least 1")
        if self.log_format not in ("json", "text"):
            raise ConfigError("log_format: use json or text")
        if self.metrics_port < 0 or self.metrics_port > 65535:
            raise ConfigError("metrics_port must be 0 (off) or a TCP port")


_SIZES = {"host_size", "disk_size", "device_size"}
_DURATIONS = {"session_timeout", "drain_timeout", "fsync_interval", "prefetch_hold"}


def _coerce(key: str, value: Any) -> Any:
    kind = {f.name: f.type for f in fields(DaemonConfig)}[key]
    if key in _SIZES:
        try:
            return parse_size(value)
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc}") from None
    if key in _DURATIONS:
        return parse_seconds(value, key)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}: {value!r} is not a boolean (true/false)")
    if kind == "int":
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: {value!r} is not an integer") from None
    return str(value)


def _read_toml(path: str, what: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} {path}: {exc}") from None


def load_config(path: str | None, env: dict[str, str], flags: dict[str, Any]) -> DaemonConfig:
    """Merge defaults, the TOML file at `path`, KVTIER_<KEY> variables and flags (not None)."""
    known = {f.name for f in fields(DaemonConfig)}
    merged: dict[str, Any] = {}
    if path:
        for key, value in _read_toml(path, "config file").items():
            if key not in known:
                raise ConfigError(f"config file {path}: unknown key {key!r}; see docs/configuration.md")
            merged[key] = _coerce(key, value)
    for key in known:
        value = env.get(f"KVTIER_{key.upper()}")
        if value is not None and value != "":
            merged[key] = _coerce(key, value)
    for key, value in flags.items():
        if value is not None:
            merged[key] = _coerce(key, value)
    return DaemonConfig(**merged).resolved()


def load_tokens(path: str) -> dict[str, frozenset[str]]:
    """token -> namespaces it may use ("*" = any)."""
    table = _read_toml(path, "tokens file").get("tokens")
    if not isinstance(table, dict) or not table:
        raise ConfigError(f'tokens file {path}: needs a [tokens] table, e.g. "s3cret" = ["tenant-a"]')
    tokens = {}
    for token, namespaces in table.items():
        if len(token) < 16:
            raise ConfigError(f"tokens file {path}: a token is shorter than 16 characters; use long random tokens")
        if not isinstance(namespaces, list) or not all(isinstance(n, str) and n for n in namespaces):
            raise ConfigError(f"tokens file {path}: each token maps to a list of namespace names")
        tokens[token] = frozenset(namespaces)
    return tokens
