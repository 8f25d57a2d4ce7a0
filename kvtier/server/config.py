"""Daemon configuration: one frozen, typed tree (`DaemonConfig`) built from defaults < TOML
file < KVTIER_* environment variables < command-line flags (later wins).

`OPTIONS` is the one table of options: the TOML reader, the environment reader, the flags
of `kvtier serve` (kvtier/server/cli.py) and the table in docs/configuration.md (checked by
tests/server/test_config.py) all come from it. An option's key is its TOML key, its
variable is KVTIER_<KEY> and its flag --<key> with dashes; `section` and `field` say where
it lands in the tree. The TOML file is flat (keys as listed, no sections).
"""
from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from kvtier_client.event_media import DEFAULT_MEDIA
from kvtier_client.integrations.daemon_settings import default_socket

from kvtier.codecs import CODECS
from kvtier.core.history import DEFAULT_HISTORY_SIZE
from kvtier.core.cluster import ClusterWrite
from kvtier.events import DEFAULT_CLUSTER_TOPIC, DEFAULT_ENGINE_PORT, DEFAULT_TOPIC, EventFormat
from kvtier.mechanism.cluster.backends import check_url
from kvtier.mechanism.disk import FsyncPolicy
from kvtier.mechanism.seal import Sealer
from kvtier.policy import POLICIES, AdmissionName
from kvtier.policy.admission import DEFAULT_THRESHOLD
from kvtier.registry import Registry, RegistryError
from kvtier.units import parse_duration, parse_size

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


class ConfigError(ValueError):
    """The configuration is unusable; the message says which key and how to fix it."""


class AuthMode(str, Enum):
    """tokens: every Register carries a bearer token that must grant the namespace;
    none: whoever can open the socket may use any namespace."""

    TOKENS = "tokens"
    NONE = "none"

    def __str__(self) -> str:
        return self.value


class LogFormat(str, Enum):
    JSON = "json"
    TEXT = "text"

    def __str__(self) -> str:
        return self.value


# -- the tree -----------------------------------------------------------------
@dataclass(frozen=True)
class ListenConfig:
    socket: str  # absolute Unix socket path
    tcp: str  # host:port to also listen on; "" = none
    tls_cert: str
    tls_key: str
    tls_client_ca: str  # set = mutual TLS: clients must present a certificate it signed
    insecure: bool  # allow TCP without TLS (loopback testing only)
    lane: bool  # serve the same-host fast lane (<socket>.lane) for the hot calls
    local_first_message_timeout: float  # seconds from connecting to the handoff socket or the lane to the first message
    local_connections_per_uid: int  # open connections per peer uid, per local socket (4x that in all)


@dataclass(frozen=True)
class AuthConfig:
    mode: AuthMode
    tokens_file: str  # TOML: [tokens] "<token>" = ["namespace", ...] ("*" = any)
    max_namespaces: int  # namespaces admitted besides those the tokens file names (kvtier.server.namespaces)


@dataclass(frozen=True)
class TiersConfig:
    """The tiers of each page layout's pool (kvtier.server.pools.Pool takes this section
    as it is) and how many pools the registry keeps (`max_pools`)."""

    host_size: int
    disk_size: int
    device_size: int  # 0 = no device tier
    gpu: int
    cache_dir: str  # absolute; the disk tier's directory
    policy: str  # a name in kvtier.policy.POLICIES (built in, an entry point's, or a module path)
    disk_admission: AdmissionName
    disk_admission_threshold: float
    write_through: bool
    fsync: FsyncPolicy
    fsync_interval: float
    io_depth: int
    max_queued_prefetch: int
    prefetch_hold: float
    arena_prefix: str
    max_pools: int
    history_size: int  # departed blocks each pool remembers, all namespaces together (kvtier.core.history)
    warm_restart_window: float  # seconds the keeper holds a crashed daemon's host memory; 0 = no keeper
    keeper_socket: str  # a standalone arena keeper (kvtier keeper) to use instead of spawning one; "" = spawn
    seal_key_file: str  # "" = seals are unkeyed checksums (kvtier.mechanism.seal); a secret file = keyed MACs
    codec: str  # how disk and cluster pages are stored (kvtier.codecs.CODECS); a namespace's tokens-file key overrides


@dataclass(frozen=True)
class ClusterConfig:
    """The cluster tier (kvtier.mechanism.cluster): a store every node shares, through the
    backend its URL's scheme names (Redis or Valkey Cluster built in); `url` "" = none."""

    url: str  # <scheme>://...: redis://[user[:password]@]host:port,host:port (rediss:// for TLS)
    password_file: str  # the password, from a file (kept off the command line); overrides the URL's
    tls_ca: str  # PEM CA that signed the cluster's certificates (rediss://)
    acl_file: str  # TOML: [namespaces."<namespace>"] username = "...", password = "..." (a store user per tenant)
    prefix: str  # first part of every key: `<prefix>:<layout>:<namespace>:<key hex>`
    write: ClusterWrite  # when pages are copied to the cluster: at commit, at demotion to disk, or never
    timeout: float  # seconds: every socket operation
    queue: int  # bytes of committed pages waiting for the cluster writer per pool; 0 = a quarter of host_size


@dataclass(frozen=True)
class EventsConfig:
    """KV events (kvtier.events, docs/events.md); `endpoint` "" = none."""

    endpoint: str  # ZMQ PUB: tcp://*:5557 binds, tcp://host:5557 connects (as vLLM)
    topic: str  # per namespace and engine: {pod_ip}, {port}, {model}, {node}, {host}, {namespace} (kvtier.events.topics)
    cluster_topic: str  # the cluster tier's copies, shared by every daemon
    format: EventFormat  # map (vLLM >= 0.28) or array (the older layout llm-d parses)
    namespaces: str  # published on ZMQ: "a,b" or "*"; "" = * without tokens, required with them (kvtier.events.access)
    connect: bool  # may dial out to an endpoint without a wildcard (it gets every published prompt)
    curve_secret_key_file: str  # the daemon's ZMQ secret certificate: CurveZMQ on ("" = plain ZMQ)
    curve_clients_dir: str  # the public certificates (*.key) of the clients CurveZMQ lets in
    media: str  # tier=MEDIUM,... renaming kvtier_client.event_media.DEFAULT_MEDIA
    models: str  # namespace=served model,... where engines do not name theirs
    reannounce: float  # seconds between re-announces of the whole state; 0 = on joins only
    pod_ip: str  # this daemon's pod IP ("" = what the host name resolves to)
    engine_port: int  # the serving port of the engine in this pod
    node_name: str  # this node's name ("" = the host name)


@dataclass(frozen=True)
class SessionsConfig:
    session_timeout: float
    drain_timeout: float
    max_sessions: int  # open at once; a quarter of them per token or client certificate


@dataclass(frozen=True)
class MetricsConfig:
    port: int  # 0 = no Prometheus endpoint
    host: str


@dataclass(frozen=True)
class LogConfig:
    level: str
    format: LogFormat


@dataclass(frozen=True)
class DaemonConfig:
    listen: ListenConfig
    auth: AuthConfig
    tiers: TiersConfig
    cluster: ClusterConfig
    events: EventsConfig
    sessions: SessionsConfig
    metrics: MetricsConfig
    log: LogConfig


_SECTIONS: dict[str, type] = {
    "listen": ListenConfig, "auth": AuthConfig, "tiers": TiersConfig, "cluster": ClusterConfig,
    "events": EventsConfig, "sessions": SessionsConfig,
    "metrics": MetricsConfig, "log": LogConfig,
}


# -- value kinds ----------------------------------------------------------------
def parse_seconds(text: str | float, key: str, *, zero: bool = False) -> float:
    """'5s', '500ms', '1h30m', '2', 2.5 -> seconds (0 only with `zero`); kvtier.units.parse_duration reads it."""
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    if value < 0 or (value == 0 and not zero):
        raise ConfigError(f"{key}: duration must be positive{' or 0' if zero else ''}")
    return value


def _seconds_or_zero(text: str | float, key: str) -> float:
    return parse_seconds(text, key, zero=True)


def _size(value: Any, key: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def _bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}: {value!r} is not a boolean (true/false)")


def _int(value: Any, key: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: {value!r} is not an integer") from None


def _fraction(value: Any, key: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: {value!r} is not a number") from None
    if not 0 <= number <= 1:
        raise ConfigError(f"{key}: {value!r} is not between 0 and 1")
    return number


def _text(value: Any, key: str) -> str:
    return str(value)


@dataclass(frozen=True)
class Kind:
    """How an option's value is read (from TOML, the environment or a flag) and shown."""

    metavar: str
    parse: Callable[[Any, str], Any]
    choices: tuple[str, ...] = ()  # offered by the flag; an enum kind also refuses others
    extensible: bool = False  # the choices are the built-in names of a registry: others are taken too
    #: Read only once the layers are merged: a bad value in the file that a flag or a
    #: variable overrides is no error (sizes, durations and numbers are read per layer).
    read_last: bool = False

    @staticmethod
    def of(enum: type[Enum], *, optional: bool = False) -> Kind:
        """Values of `enum`; with `optional`, "" reads as None (a default derived later)."""
        names = tuple(member.value for member in enum)
        listed = f"{', '.join(names[:-1])} or {names[-1]}"

        def parse(value: Any, key: str) -> Enum | None:
            if optional and value == "":
                return None
            try:
                return enum(str(value))
            except ValueError:
                raise ConfigError(f"{key}: unknown {str(value)!r}; use {listed}") from None

        return Kind("|".join(names), parse, names, read_last=True)

    @staticmethod
    def named(registry: Registry) -> Kind:
        """A name in `registry` (kvtier.registry): a built-in one (the flag offers those,
        and the Helm chart, which runs the stock image, takes only those), an entry
        point's, or a module path. A plugin is loaded and checked here, so one that is
        unknown or does not fit fails at start with the registry's message: the known
        names, and how to add one."""
        def parse(value: Any, key: str) -> str:
            name = str(value)
            try:
                registry[name]
            except RegistryError as exc:
                raise ConfigError(f"{key}: {exc}") from None
            return name

        names = registry.builtin
        return Kind(f"[{'|'.join(names)}|MODULE:NAME]", parse, names, extensible=True, read_last=True)


TEXT = Kind("TEXT", _text)
PATH = Kind("PATH", _text)
INT = Kind("INTEGER", _int)
BOOL = Kind("", _bool)
FRACTION = Kind("FRACTION", _fraction)
SIZE = Kind("SIZE", _size)
DURATION = Kind("DURATION", parse_seconds)
DURATION_OR_ZERO = Kind("DURATION", _seconds_or_zero)
LOG_LEVELS = Kind("LEVEL", _text, ("debug", "info", "warning", "error"))  # as given to logging; not refused here


@dataclass(frozen=True)
class Option:
    key: str  # TOML key; KVTIER_<KEY>; --<key-with-dashes>
    section: str
    kind: Kind
    default: Any  # written as in a TOML file; for "" `shown` says what it means (off, or derived at load time)
    help: str  # one line for `kvtier serve --help`; docs/configuration.md says more
    shown: str = ""  # the default as --help and the docs show it, when not the default itself
    field: str = ""  # the field in its section, when not the key
    off_flag: str = ""  # a boolean's negative flag (--write-back)
    metavar: str = ""  # when not the kind's

    @property
    def env(self) -> str:
        return f"KVTIER_{self.key.upper()}"

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def attr(self) -> str:
        return self.field or self.key

    def read(self, value: Any) -> Any:
        """The typed value of `value` as written in TOML, the environment or a flag."""
        return self.kind.parse(value, self.key)

    @property
    def default_text(self) -> str:
        if self.shown:
            return self.shown
        if isinstance(self.default, bool):
            return str(self.default).lower()
        return str(self.default)


OPTIONS: tuple[Option, ...] = (
    Option("socket", "listen", PATH, "", "Unix socket path (created with mode 0660).",
           shown="$XDG_RUNTIME_DIR/kvtier/kvtier.sock"),
    Option("tcp", "listen", TEXT, "", "Also listen on HOST:PORT over TLS (needs --tls-cert/--tls-key, or --insecure).",
           shown="off", metavar="HOST:PORT"),
    Option("tls_cert", "listen", PATH, "", "PEM certificate for TCP.", shown="none"),
    Option("tls_key", "listen", PATH, "", "PEM private key for TCP.", shown="none"),
    Option("tls_client_ca", "listen", PATH, "", "PEM CA: require client certificates it signed (mutual TLS).", shown="none"),
    Option("insecure", "listen", BOOL, False, "Allow plaintext TCP (trusted loopback only)."),
    Option("lane", "listen", BOOL, True, "Serve the same-host fast lane (<socket>.lane): the hot calls as binary "
           "frames on a Unix socket; --no-lane leaves every client on gRPC.", off_flag="no-lane"),
    Option("local_first_message_timeout", "listen", DURATION, "1s", "Drop a connection to the handoff socket or the "
           "lane that sends nothing this long after connecting (each on its own clock: others are served meanwhile)."),
    Option("local_connections_per_uid", "listen", INT, 256, "Connections one peer uid may hold open on the handoff "
           "socket, and on the lane; past it that uid is refused, others are not (4x this in all).", metavar="N"),
    Option("auth", "auth", Kind.of(AuthMode, optional=True), "", "Namespace authorisation.",
           shown="tokens if tokens_file is set, else none", field="mode"),
    Option("tokens_file", "auth", PATH, "", 'TOML file: [tokens] "<token>" = ["namespace", ...].', shown="none"),
    Option("max_namespaces", "auth", INT, 64, "Namespaces the daemon admits besides those the tokens file names; a new "
           "one past it is refused (RESOURCE_EXHAUSTED).", metavar="N"),
    Option("cache_dir", "tiers", PATH, "", "Disk tier directory.", shown="$XDG_CACHE_HOME/kvtier"),
    Option("host_size", "tiers", SIZE, "1GiB", "Host tier size per layout, e.g. 8GiB."),
    Option("disk_size", "tiers", SIZE, "8GiB", "Disk tier size per layout, e.g. 100GiB; 0 for none."),
    Option("device_size", "tiers", SIZE, "0", "GPU HBM per layout for the device tier, e.g. 40GiB; needs CUDA and CuPy; 0 = none."),
    Option("gpu", "tiers", INT, 0, "CUDA device index of the device tier.", metavar="INDEX"),
    Option("policy", "tiers", Kind.named(POLICIES), "frecency",
           "Eviction policy: frecency (recency and reuse, self-tuned), prefix (prefix-aware LRU), lru, a candidate "
           "measured against them (arc, s3fifo, tinylfu), or your own: MODULE:CLASS or an entry point's name "
           "(docs/policies.md)."),
    Option("codec", "tiers", Kind.named(CODECS), "identity", "How disk and cluster pages are stored: identity (as "
           "they are), zstd (lossless), or, on float16/bfloat16/float32 pages, lossy k16v8 (~1.33x), int8 (~1.87x), "
           "fp8 (~2x) or int4 (~3x), or your own (MODULE:CLASS or an entry point's name); a namespace's codec key "
           "in the tokens file overrides it (docs/tiers.md, \"Codecs\")."),
    Option("disk_admission", "tiers", Kind.of(AdmissionName), "reuse", "Which host pages are written to disk as they "
           "leave host: reuse (only kinds of pages that come back often enough, see --disk-admission-threshold), or all."),
    Option("disk_admission_threshold", "tiers", FRACTION, DEFAULT_THRESHOLD, "For --disk-admission reuse: the share "
           "of pages read back for which a disk write pays (0.1: one in ten)."),
    Option("write_through", "tiers", BOOL, False, "Copy pages to disk at commit, or only when evicted (write-back).",
           off_flag="write-back"),
    Option("fsync", "tiers", Kind.of(FsyncPolicy), "batch",
           "When disk pages become durable: before their index commits (batch), every --fsync-interval, or never."),
    Option("fsync_interval", "tiers", DURATION, "1s", "Flush period for --fsync interval."),
    Option("io_depth", "tiers", INT, 8, "Disk reads and writes in flight per pool (1 to 256).", metavar="N"),
    Option("max_queued_prefetch", "tiers", INT, 1024,
           "Prefetch loads queued per pool; more hints are dropped (1024: four 4,096-token prefixes of 16-token pages).",
           metavar="N"),
    Option("prefetch_hold", "tiers", DURATION, "10s", "How long a prefetched page is kept unless acquired."),
    Option("arena_prefix", "tiers", TEXT, "", "Name prefix of host memory files (as /proc/<pid>/maps shows them).",
           shown="derived from the socket path", metavar="NAME"),
    Option("max_pools", "tiers", INT, 4, "Distinct page layouts served at once.", metavar="N"),
    Option("history_size", "tiers", INT, DEFAULT_HISTORY_SIZE, "Evicted blocks each pool remembers (all namespaces together) to "
           "say why a key missed; ~256 B each.", metavar="N"),
    Option("warm_restart_window", "tiers", DURATION_OR_ZERO, "5m",
           "How long the arena keeper holds a crashed daemon's host pages for its successor (0 = a crash loses them)."),
    Option("keeper_socket", "tiers", PATH, "", "Socket of a standalone arena keeper (kvtier keeper, e.g. a sidecar "
           "container) to use instead of spawning one; its --window then applies.", shown="none: spawn one"),
    Option("seal_key_file", "tiers", PATH, "", "Secret (>= 16 bytes, mode 0600) that seals disk and cluster pages "
           "to their key with a keyed MAC; shared by every node of a cluster.", shown="none"),
    Option("cluster", "cluster", TEXT, "", "Cluster tier below disk, shared by nodes; the URL's scheme names the "
           "backend: redis://[USER[:PASSWORD]@]HOST:PORT,HOST:PORT (Redis or Valkey Cluster; rediss:// for TLS), or "
           "a scheme an installed backend registers (docs/tiers.md).", shown="off", field="url", metavar="URL"),
    Option("cluster_password_file", "cluster", PATH, "", "File holding the cluster password (overrides the URL's).",
           shown="none", field="password_file"),
    Option("cluster_tls_ca", "cluster", PATH, "", "PEM CA of the cluster's TLS certificates (rediss://, or another "
           "TLS scheme).", shown="system",
           field="tls_ca"),
    Option("cluster_acl_file", "cluster", PATH, "", 'TOML: [namespaces."NS"] username, password: a cluster user per '
           "namespace (Redis: an ACL user).", shown="none", field="acl_file"),
    Option("cluster_prefix", "cluster", TEXT, "kvtier", "First part of every cluster key (<prefix>:<layout>:<namespace>:<key>).",
           field="prefix", metavar="PREFIX"),
    Option("cluster_write", "cluster", Kind.of(ClusterWrite), "commit", "When pages are copied to the cluster: at commit, "
           "when demoted from host to disk, or off (this node only reads it).", field="write"),
    Option("cluster_timeout", "cluster", DURATION, "500ms", "Timeout of every cluster socket operation.", field="timeout"),
    Option("cluster_queue", "cluster", SIZE, "0", "Committed pages waiting for the cluster writer, per layout; more are "
           "not written.", shown="host_size / 4", field="queue"),
    Option("events", "events", TEXT, "", "Publish KV events (vLLM's format) on this ZMQ endpoint: tcp://*:5557 binds, "
           "tcp://HOST:PORT connects; watch: WatchEvents only.", shown="off", field="endpoint", metavar="ENDPOINT"),
    Option("events_topic", "events", TEXT, DEFAULT_TOPIC, "ZMQ topic of a namespace's events for each engine using it "
           "({pod_ip}, {port}, {model}, {node}, {host}, {namespace}); llm-d's is the default.",
           field="topic", metavar="TOPIC"),
    Option("events_cluster_topic", "events", TEXT, DEFAULT_CLUSTER_TOPIC, "ZMQ topic of the cluster tier's copies, "
           "shared by every daemon (same fields).", field="cluster_topic", metavar="TOPIC"),
    Option("events_media", "events", TEXT, "", "Rename tiers' media in events: TIER=MEDIUM,... (defaults "
           + ", ".join(f"{tier.label}={medium}" for tier, medium in DEFAULT_MEDIA.items()) + ").",
           shown=",".join(DEFAULT_MEDIA.values()), field="media", metavar="TIER=M,..."),
    Option("events_models", "events", TEXT, "", "The served model name of each namespace's engines, for {model}: "
           "NS=MODEL,... (an engine that names its model at Register wins).", shown="the namespace", field="models",
           metavar="NS=MODEL,..."),
    Option("events_reannounce", "events", DURATION_OR_ZERO, "5m", "Tell ZMQ subscribers every copy held this often, "
           "for routers that lost messages (also when a subscriber or an engine joins; 0 = only then).",
           field="reannounce"),
    Option("pod_ip", "events", TEXT, "", "This daemon's pod IP, for {pod_ip} (Kubernetes: fieldRef status.podIP).",
           shown="the host name's address", metavar="IP"),
    Option("engine_port", "events", INT, DEFAULT_ENGINE_PORT, "The serving port of the engine in this pod, for {port}.",
           metavar="PORT"),
    Option("node_name", "events", TEXT, "", "This node's name, for {node} (Kubernetes: fieldRef spec.nodeName).",
           shown="the host name", metavar="NAME"),
    Option("events_format", "events", Kind.of(EventFormat), "map", "Event layout: map (vLLM >= 0.28) or array (llm-d).",
           field="format"),
    Option("events_namespaces", "events", TEXT, "", "Namespaces whose events go out on the ZMQ endpoint: NS,NS or * "
           "(WatchEvents is not affected).", shown="* without tokens; required with tokens", field="namespaces",
           metavar="NS,NS"),
    Option("events_connect", "events", BOOL, False, "Let --events dial out to an endpoint without a wildcard: "
           "whoever listens there gets the published token ids (prompts).", field="connect"),
    Option("events_curve_secret_key_file", "events", PATH, "", "The daemon's ZMQ secret certificate: CurveZMQ on the "
           "events endpoint (needs --events-curve-clients-dir).", shown="none", field="curve_secret_key_file"),
    Option("events_curve_clients_dir", "events", TEXT, "", "Directory of the public certificates (*.key) of the "
           "clients CurveZMQ lets in.", shown="none", field="curve_clients_dir", metavar="DIR"),
    Option("session_timeout", "sessions", DURATION, "3s", "Release a silent client's leases after this long."),
    Option("drain_timeout", "sessions", DURATION, "10s", "On SIGTERM, wait this long for leases to be released, then as long again at most for copying host pages to disk."),
    Option("max_sessions", "sessions", INT, 1024, "Sessions open at once; one token or client "
           "certificate may hold a quarter of them.", metavar="N"),
    Option("metrics_port", "metrics", INT, 0, "Serve Prometheus metrics on this port (0 = off).", field="port", metavar="PORT"),
    Option("metrics_host", "metrics", TEXT, "127.0.0.1", "Address for the metrics endpoint.", field="host", metavar="HOST"),
    Option("log_level", "log", LOG_LEVELS, "info", "Log level.", field="level"),
    Option("log_format", "log", Kind.of(LogFormat), "json", "One JSON object per line, or plain text.", field="format"),
)
BY_KEY: dict[str, Option] = {o.key: o for o in OPTIONS}


# -- loading --------------------------------------------------------------------
def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvtier")


def read_toml(path: str, what: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} {path}: {exc}") from None


def load_config(path: str | None, env: Mapping[str, str], flags: Mapping[str, Any]) -> DaemonConfig:
    """Merge defaults, the TOML file at `path`, KVTIER_<KEY> variables and flags (not None)."""
    given: dict[str, Any] = {}  # typed values, or as written for the `read_last` kinds

    def take(option: Option, value: Any) -> None:
        given[option.key] = value if option.kind.read_last else option.read(value)

    if path:
        for key, value in read_toml(path, "config file").items():
            if key not in BY_KEY:
                raise ConfigError(f"config file {path}: unknown key {key!r}; see docs/configuration.md")
            take(BY_KEY[key], value)
    for option in OPTIONS:
        value = env.get(option.env)
        if value is not None and value != "":
            take(option, value)
    for key, value in flags.items():
        if value is not None:
            take(BY_KEY[key], value)
    values = {}
    for o in OPTIONS:
        typed = o.key in given and not o.kind.read_last
        values[o.key] = given[o.key] if typed else o.read(given.get(o.key, o.default))
    config = _tree(_resolve(values))
    _validate(config)
    return config


def _resolve(values: dict[str, Any]) -> dict[str, Any]:
    """Fill the derived defaults."""
    socket = os.path.abspath(values["socket"] or default_socket())
    return {
        **values,
        "socket": socket,
        "cache_dir": os.path.abspath(values["cache_dir"] or _default_cache_dir()),
        "arena_prefix": values["arena_prefix"] or "kvtier-" + hashlib.sha256(socket.encode()).hexdigest()[:8],
        "auth": values["auth"] or (AuthMode.TOKENS if values["tokens_file"] else AuthMode.NONE),
    }


def _tree(values: Mapping[str, Any]) -> DaemonConfig:
    sections = {
        name: cls(**{o.attr: values[o.key] for o in OPTIONS if o.section == name}) for name, cls in _SECTIONS.items()
    }
    return DaemonConfig(**sections)


def default_tiers(**fields: Any) -> TiersConfig:
    """The tiers section at the option table's defaults with `fields` (by field name) over
    them: for a pool made outside the daemon (tests, benchmarks). Neither resolved nor
    checked as load_config's is: cache_dir and arena_prefix stay "" unless given."""
    defaults = {o.attr: o.read(o.default) for o in OPTIONS if o.section == "tiers"}
    return replace(TiersConfig(**defaults), **fields)


def _validate(cfg: DaemonConfig) -> None:
    """Refuse combinations that cannot work; raises ConfigError with a one-line reason."""
    listen, tiers = cfg.listen, cfg.tiers
    if cfg.auth.mode is AuthMode.TOKENS and not cfg.auth.tokens_file:
        raise ConfigError("auth = tokens needs tokens_file (a TOML file with a [tokens] table)")
    if listen.tcp:
        m = re.fullmatch(r".+:([0-9]+)", listen.tcp)
        if not m or not 0 < int(m.group(1)) <= 65535:
            raise ConfigError(f"tcp: {listen.tcp!r} is not host:port with a port from 1 to 65535")
        if not (listen.tls_cert and listen.tls_key) and not listen.insecure:
            raise ConfigError("tcp needs tls_cert and tls_key, or --insecure for plaintext on a trusted loopback")
        if cfg.auth.mode is AuthMode.NONE and not listen.insecure:
            raise ConfigError("tcp with auth = none would let anyone on the network in: configure tokens_file")
    if bool(listen.tls_cert) != bool(listen.tls_key):
        raise ConfigError("tls_cert and tls_key go together")
    if listen.local_connections_per_uid < 1:
        raise ConfigError("local_connections_per_uid must be at least 1 (a client needs a connection to attach)")
    if tiers.host_size <= 0:
        raise ConfigError("host_size must be positive: the host tier is where engines read and write pages")
    if tiers.device_size < 0 or tiers.gpu < 0:
        raise ConfigError("device_size and gpu must be >= 0 (device_size 0 = no device tier)")
    if tiers.io_depth < 1 or tiers.io_depth > 256:
        raise ConfigError("io_depth must be between 1 and 256")
    if tiers.max_queued_prefetch < 0:
        raise ConfigError("max_queued_prefetch must be >= 0 (0 turns prefetch off)")
    if tiers.max_pools < 1:
        raise ConfigError("max_pools must be at least 1")
    if tiers.history_size < 0 or cfg.auth.max_namespaces < 1:
        raise ConfigError("history_size must be >= 0 (0 = no miss history) and max_namespaces at least 1")
    if cfg.cluster.url:
        try:
            check_url(cfg.cluster.url)
        except ValueError as exc:
            raise ConfigError(f"cluster: {exc}") from None
        if not cfg.cluster.prefix or ":" in cfg.cluster.prefix:
            raise ConfigError("cluster_prefix must be non-empty and without ':' (it is the first part of every key)")
        if cfg.cluster.password_file and not os.access(cfg.cluster.password_file, os.R_OK):
            raise ConfigError(f"cluster_password_file {cfg.cluster.password_file} cannot be read")
        if cfg.cluster.acl_file:
            for namespace, user in read_toml(cfg.cluster.acl_file, "cluster_acl_file").get("namespaces", {}).items():
                if not isinstance(user, dict) or not isinstance(user.get("username"), str):
                    raise ConfigError(f'cluster_acl_file {cfg.cluster.acl_file}: [namespaces."{namespace}"] needs '
                                      'username = "..." (and password = "...")')
        if cfg.cluster.write is ClusterWrite.DEMOTE and tiers.disk_size == 0:
            raise ConfigError("cluster_write = demote copies pages as they are demoted to disk: it needs a disk tier "
                              "(disk_size > 0); use commit")
        if cfg.cluster.timeout <= 0:
            raise ConfigError("cluster_timeout must be positive")
    if tiers.seal_key_file:
        try:
            Sealer.from_file(tiers.seal_key_file)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if cfg.sessions.max_sessions < 1:
        raise ConfigError("max_sessions must be at least 1")
    if cfg.metrics.port < 0 or cfg.metrics.port > 65535:
        raise ConfigError("metrics_port must be 0 (off) or a TCP port")


# -- the docs' table --------------------------------------------------------------
def docs_rows() -> list[str]:
    """How each row of docs/configuration.md's table starts: key, section, default (in table order)."""
    return [f"| `{o.key}` | {o.section} | {o.default_text} |" for o in OPTIONS]
