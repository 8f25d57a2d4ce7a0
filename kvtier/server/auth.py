"""Who may use which namespace: bearer tokens from the tokens file (auth = tokens), or
anyone who can open the socket (auth = none)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvtier_client.errors import PermissionDenied, Unauthenticated

from kvtier.server.config import AuthConfig, AuthMode, ConfigError, read_toml

#: gRPC invocation metadata: (key, value) pairs.
Metadata = Sequence[tuple[str, str]]


def load_tokens(path: str) -> dict[str, frozenset[str]]:
    """token -> namespaces it may use ("*" = any)."""
    table = read_toml(path, "tokens file").get("tokens")
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


class Authorizer:
    def __init__(self, tokens: Mapping[str, frozenset[str]] | None) -> None:
        """`tokens`: token -> namespaces it grants ("*" = any); None = no authorisation."""
        self._tokens = tokens

    @classmethod
    def from_config(cls, auth: AuthConfig) -> "Authorizer":
        return cls(load_tokens(auth.tokens_file) if auth.mode is AuthMode.TOKENS else None)

    def authorize(self, namespace: str, metadata: Metadata) -> None:
        """Raise unless the call's token grants `namespace`."""
        if self._tokens is None:
            return
        token = _token(metadata)
        if token is None or token not in self._tokens:
            raise Unauthenticated("missing or unknown token: send 'authorization: Bearer <token>' with a token the daemon is configured with")
        allowed = self._tokens[token]
        if "*" not in allowed and namespace not in allowed:
            raise PermissionDenied(f"this token may not use namespace {namespace!r}; ask the operator to grant it")

    def authenticate_any(self, metadata: Metadata) -> None:
        """Stats shows counts only, but still needs a valid token when tokens are on."""
        if self._tokens is not None and _token(metadata) not in self._tokens:
            raise Unauthenticated("missing or unknown token: send 'authorization: Bearer <token>'")


def _token(metadata: Metadata) -> str | None:
    for key, value in metadata:
        if key == "authorization" and value.startswith("Bearer "):
            return value[len("Bearer ") :]
    return None
