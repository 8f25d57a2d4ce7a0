"""The tier's entry in `secondary_tiers`, checked into a `TierSettings`.

vLLM's `SecondaryTierFactory` passes every key of the entry except `type`, `module_path` and
`backpressure` to the tier's constructor; these are the ones this tier reads (the package
docstring and docs/vllm-offloading.md list them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier_client.client import KVTierClient
from kvtier_client.connection import Backoff
from kvtier_client.integrations.daemon_settings import default_target, resolve_token

#: Keys of the tier's config entry this tier reads.
SETTING_KEYS = ("target", "namespace", "token", "token_file", "salt", "connect_timeout", "io_threads", "locality")


def _text(settings: dict[str, Any], key: str) -> str | None:
    value = settings.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"kvtier secondary tier: {key} must be a non-empty string, got {value!r}")
    return value


def _token(settings: dict[str, Any]) -> str | None:
    return resolve_token(_text(settings, "token"), _text(settings, "token_file"), "kvtier secondary tier")


def _positive(settings: dict[str, Any], key: str, default: float, *, whole: bool) -> float:
    value = settings.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) or value <= 0:
        kind = "a whole number >= 1" if whole else "positive seconds"
        raise ValueError(f"kvtier secondary tier: {key} must be {kind}, got {value!r}")
    return value


@dataclass(frozen=True)
class TierSettings:
    """What the tier's config entry asked for, checked."""

    target: str
    namespace: str | None = None  # None: "vllm-offload/<model name>" (identity.default_namespace)
    token: str | None = field(default=None, repr=False)
    salt: bytes = b""  # enters every key: pages of different salts never match
    connect_timeout: float = 5.0  # how long one call retries an unreachable daemon
    io_threads: int = 2  # threads running stores and loads
    locality: str | None = None  # vLLM's Locality name (LOCAL, REMOTE) for its tier filters

    @classmethod
    def from_kwargs(cls, settings: dict[str, Any]) -> TierSettings:
        unknown = sorted(set(settings) - set(SETTING_KEYS))
        if unknown:
            raise ValueError(
                f"kvtier secondary tier: unknown setting(s) {unknown} in its secondary_tiers entry; "
                f"the settings are {', '.join(SETTING_KEYS)}"
            )
        target = _text(settings, "target") or default_target()
        if not target.startswith("unix:///"):
            raise ValueError(
                f"kvtier secondary tier: target {target!r} is not 'unix:///abs/path.sock': the tier copies rows "
                "through the daemon's shared memory, so it needs the daemon on this host"
            )
        return cls(
            target=target, namespace=_text(settings, "namespace"), token=_token(settings),
            salt=(_text(settings, "salt") or "").encode(),
            connect_timeout=float(_positive(settings, "connect_timeout", cls.connect_timeout, whole=False)),
            io_threads=int(_positive(settings, "io_threads", cls.io_threads, whole=True)),
            locality=_text(settings, "locality"),
        )

    def client(self, name: str) -> KVTierClient:
        """A client that maps the namespace's host arena: stores and loads copy in place."""
        return KVTierClient(self.target, token=self.token, name=name, backoff=Backoff(total=self.connect_timeout),
                            timeout=max(30.0, self.connect_timeout))
