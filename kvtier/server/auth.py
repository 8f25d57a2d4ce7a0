"""Who may use which namespace, and how much of each tier a namespace may hold: both from
the tokens file. With auth = tokens a call needs a bearer token the file grants the
namespace; with auth = none anyone who can open the socket may use any namespace, and the
file (if any) only sets quotas. SIGHUP re-reads the file (`Authorizer.reload`): the new
table replaces the old one whole, so a removed token stops working at the next call."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from kvtier_client.errors import InvalidArgument, PermissionDenied, Unauthenticated

from kvtier.codecs import CODECS
from kvtier.registry import RegistryError
from kvtier.core import Quota, check_namespace
from kvtier.server.config import AuthConfig, AuthMode, ConfigError, read_toml

#: gRPC invocation metadata: (key, value) pairs.
Metadata = Sequence[tuple[str, str]]
#: The keys of a [namespaces.<name>] table.
QUOTA_KEYS = tuple(f.name for f in fields(Quota))


@dataclass(frozen=True)
class AccessTable:
    """One reading of the tokens file."""

    tokens: Mapping[str, frozenset[str]]  # token -> namespaces it grants ("*" = any)
    quotas: Mapping[str, Quota]  # namespace -> its quota; namespaces not listed have none
    codecs: Mapping[str, str] = field(default_factory=dict)  # namespace -> its codec (kvtier.codecs); else the option


def load_access_table(path: str, *, need_tokens: bool) -> AccessTable:
    """Read and check the tokens file; ConfigError names the file, the entry and the fix."""
    data = read_toml(path, "tokens file")
    unknown = sorted(set(data) - {"tokens", "namespaces"})
    if unknown:
        raise ConfigError(f"tokens file {path}: unknown table or key {unknown[0]!r}; it holds a [tokens] table and "
                          "[namespaces.<name>] tables (docs/configuration.md, \"The tokens file\")")
    namespaces = data.get("namespaces", {})
    codecs = _codecs(path, namespaces)
    return AccessTable(_tokens(path, data.get("tokens"), need_tokens), _quotas(path, namespaces), codecs)


def _tokens(path: str, table: object, required: bool) -> dict[str, frozenset[str]]:
    if table is None and not required:
        return {}
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


def _codecs(path: str, table: object) -> dict[str, str]:
    """Each namespace's `codec` key, taken out of its table (the rest is its quota)."""
    codecs = {}
    for namespace, entry in table.items() if isinstance(table, dict) else ():
        if isinstance(entry, dict) and "codec" in entry:
            name = entry.pop("codec")
            try:
                CODECS[str(name)]
            except RegistryError as exc:
                raise ConfigError(f'tokens file {path}: [namespaces."{namespace}"]: {exc}') from None
            codecs[namespace] = name
    return codecs


def _quotas(path: str, table: object) -> dict[str, Quota]:
    if not isinstance(table, dict):
        raise ConfigError(f"tokens file {path}: namespaces holds one table per namespace, "
                          "e.g. [namespaces.tenant-a] with max_host_pages = 4096")
    return {namespace: _quota(f'tokens file {path}: [namespaces."{namespace}"]', namespace, entry)
            for namespace, entry in table.items()}


def _quota(where: str, namespace: str, entry: object) -> Quota:
    try:
        check_namespace(namespace)
    except InvalidArgument as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a table of page counts, e.g. max_host_pages = 4096")
    for key, value in entry.items():
        if key not in QUOTA_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r}; use {', '.join(QUOTA_KEYS)} or codec")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{where}: {key} must be a whole number of pages, 0 or more (0 = none); got {value!r}")
    quota = Quota(**entry)
    for tier in ("host", "disk"):
        limit, floor = getattr(quota, f"max_{tier}_pages"), getattr(quota, f"guaranteed_{tier}_pages")
        if limit and floor > limit:
            raise ConfigError(f"{where}: guaranteed_{tier}_pages ({floor}) exceeds max_{tier}_pages ({limit}); "
                              "lower the guarantee or raise the maximum")
    return quota


def _granted(table: AccessTable, token: str | None, namespace: str) -> bool:
    allowed = table.tokens.get(token) if token is not None else None
    return allowed is not None and ("*" in allowed or namespace in allowed)


class Authorizer:
    """Checks calls against the current access table. `reload` swaps the table in one
    assignment: a call sees the old table or the new one, never a mix."""

    def __init__(self, mode: AuthMode, path: str | None) -> None:
        """`path`: the tokens file (required with auth = tokens; optional with none)."""
        self._mode = mode
        self._path = path
        self._table = self._read()

    @classmethod
    def from_config(cls, auth: AuthConfig) -> "Authorizer":
        return cls(auth.mode, auth.tokens_file or None)

    def _read(self) -> AccessTable:
        if not self._path:
            return AccessTable({}, {})
        return load_access_table(self._path, need_tokens=self._mode is AuthMode.TOKENS)

    def reload(self) -> AccessTable:
        """Re-read the tokens file and use it from now on. On ConfigError the current table
        stays in force."""
        self._table = self._read()
        return self._table

    @property
    def quotas(self) -> Mapping[str, Quota]:
        return self._table.quotas

    @property
    def codecs(self) -> Mapping[str, str]:
        return self._table.codecs

    @staticmethod
    def token_of(metadata: Metadata) -> str | None:
        """The bearer token a call carries, if any."""
        for key, value in metadata:
            if key == "authorization" and value.startswith("Bearer "):
                return value[len("Bearer ") :]
        return None

    def grants(self, token: str | None, namespace: str) -> bool:
        """Whether `token` may use `namespace` now: always with auth = none; with tokens, when
        the current table holds the token and it grants the namespace."""
        return self._mode is not AuthMode.TOKENS or _granted(self._table, token, namespace)

    def names(self, namespace: str) -> bool:
        """Whether the tokens file names `namespace` (in a token's list or a quota table): it
        then does not count against max_namespaces (kvtier.server.namespaces)."""
        table = self._table
        return namespace in table.quotas or any(namespace in granted for granted in table.tokens.values())

    def authorize(self, namespace: str, metadata: Metadata) -> None:
        """Raise unless the call's token grants `namespace`."""
        if self._mode is not AuthMode.TOKENS:
            return
        table = self._table
        token = self.token_of(metadata)
        if token is None or token not in table.tokens:
            raise Unauthenticated("missing or unknown token: send 'authorization: Bearer <token>' with a token the daemon is configured with")
        if not _granted(table, token, namespace):
            raise PermissionDenied(f"this token may not use namespace {namespace!r}; ask the operator to grant it")

    def authenticate_any(self, metadata: Metadata) -> None:
        """Stats needs a valid token when tokens are on (it shows only what the token grants)."""
        if self._mode is AuthMode.TOKENS and self.token_of(metadata) not in self._table.tokens:
            raise Unauthenticated("missing or unknown token: send 'authorization: Bearer <token>'")
