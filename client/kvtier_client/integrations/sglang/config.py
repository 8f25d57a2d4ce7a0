"""The backend's settings: SGLang's `--hicache-storage-backend-extra-config` checked into a
`BackendConfig`, and the key scope its `HiCacheStorageConfig` implies (which model and
which shard of it a rank's pages hold).

Every key is listed in the package docstring and in docs/sglang.md.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from kvtier_client.client import KVTierClient
from kvtier_client.connection import Backoff
from kvtier_client.integrations.daemon_settings import default_target, resolve_token
from kvtier_client.keys import BlockKey

#: Keys SGLang's dynamic backend loader itself reads from the same dict.
LOADER_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
#: Keys this backend reads.
CONFIG_KEYS = ("target", "namespace", "salt", "token", "token_file", "connect_timeout", "batch_pages")


def _as_str(extra: dict[str, Any], key: str) -> str | None:
    value = extra.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"kvtier HiCache backend: extra config {key!r} must be a string, got {value!r}")
    return value


def _token(extra: dict[str, Any]) -> str | None:
    token, token_file = _as_str(extra, "token"), _as_str(extra, "token_file")
    if not token and not token_file:  # the environment's, when the config names none
        token, token_file = os.environ.get("KVTIER_TOKEN"), os.environ.get("KVTIER_TOKEN_FILE")
        token = None if token_file else token
    return resolve_token(token, token_file, "kvtier HiCache backend")


@dataclass(frozen=True)
class KeyScope:
    """Whose pages a rank's keys name: the model, and the shard of its KV this rank holds.

    Tensor-parallel ranks of a model with K/V heads hold different heads, so each rank has
    keys of its own; MLA ranks hold the same latent and share one copy (SGLang lets one rank
    write it). Pipeline stages and attention context-parallel ranks hold different layers or
    slices, so they are always apart."""

    model: str
    shard: str
    salt: str = ""

    @classmethod
    def of(cls, storage_config: Any, salt: str = "") -> KeyScope:
        c = storage_config
        parts = [] if c.is_mla_model else [f"tp{c.tp_rank}/{c.tp_size}"]
        if c.pp_size > 1:
            parts.append(f"pp{c.pp_rank}/{c.pp_size}")
        if c.attn_cp_size > 1:
            parts.append(f"cp{c.attn_cp_rank}/{c.attn_cp_size}")
        return cls(model=c.model_name or "", shard=" ".join(parts) or "all", salt=salt)

    @cached_property
    def tag(self) -> bytes:
        """16 bytes naming the scope, after SGLang's hash in every key."""
        text = f"sglang-hicache-v1\0{self.model}\0{self.shard}\0{self.salt}"
        return hashlib.sha256(text.encode()).digest()[:16]

    def key(self, page_hash: str) -> BlockKey:
        """The kvtier key of an SGLang page hash (64 hex digits: a sha256 of the page's tokens
        chained to its prefix): its 32 bytes, then the scope's tag (48 bytes in all, so
        `kvtier explain` shows SGLang's hash). ValueError for anything else."""
        raw = bytes.fromhex(page_hash)
        if len(raw) != 32:
            raise ValueError(f"SGLang page hash {page_hash!r} is not 64 hex digits")
        return BlockKey(raw + self.tag)


@dataclass(frozen=True)
class BackendConfig:
    """What the extra config asked for, checked (see the package docstring)."""

    target: str
    namespace: str
    salt: str = ""
    token: str | None = field(default=None, repr=False)
    connect_timeout: float = 10.0
    batch_pages: int = 32  # pages per borrow or acquire: bounds the host pages one call holds

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, *, model_name: str | None) -> BackendConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(CONFIG_KEYS) - set(LOADER_KEYS))
        if unknown:
            raise ValueError(
                f"kvtier HiCache backend: unknown extra config key(s) {unknown}; its keys are {', '.join(CONFIG_KEYS)}"
            )
        target = _as_str(extra, "target") or default_target()
        if not target.startswith("unix://"):
            raise ValueError(
                f"kvtier HiCache backend: target {target!r} must be a unix socket ('unix:///abs/path.sock'): the "
                "backend copies pages through the daemon's host memory, which only a same-host client maps"
            )
        namespace = _as_str(extra, "namespace") or os.environ.get("KVTIER_NAMESPACE") or (
            "sglang/" + model_name.lstrip("/") if model_name else "sglang")
        timeout = extra.get("connect_timeout", 10.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"kvtier HiCache backend: connect_timeout must be positive seconds, got {timeout!r}")
        batch = extra.get("batch_pages", cls.batch_pages)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"kvtier HiCache backend: batch_pages must be a whole number >= 1, got {batch!r}")
        return cls(target=target, namespace=namespace, salt=_as_str(extra, "salt") or "", token=_token(extra),
                   connect_timeout=float(timeout), batch_pages=batch)

    def client(self, name: str) -> KVTierClient:
        return KVTierClient(self.target, token=self.token, name=name, backoff=Backoff(total=self.connect_timeout),
                            timeout=max(30.0, self.connect_timeout))
