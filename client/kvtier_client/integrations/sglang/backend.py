"""KVTierStorage: SGLang's HiCacheStorage over a kvtier daemon.

SGLang builds it as `cls(storage_config, kwargs)` (its dynamic backend loader), then hands it
the host pool with `register_mem_pool_host`: that is when the backend learns the page layout
and registers with the daemon. With `"interface_v1": 1` SGLang calls `batch_exists`,
`batch_set_v1` and `batch_get_v1` with page-aligned `host_indices` into that pool; without
it, the generic `batch_set` / `batch_get` with flat data pages. Both paths copy once.

A failed call answers False (or 0 pages, or None) and logs why; nothing is raised into
SGLang's storage threads. After the daemon was unreachable the backend answers "nothing
stored" for RETRY_AFTER_SECONDS instead of stalling every request on retries (the client
registers again by itself once the daemon is back).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvtier_client.client import KVTierClient
from kvtier_client.errors import KVTierError, Unavailable
from kvtier_client.integrations.sglang.config import BackendConfig, KeyScope
from kvtier_client.integrations.sglang.host_pages import HostPages
from kvtier_client.integrations.sglang.page_io import load, log, store
from kvtier_client.keys import BlockKey

T = TypeVar("T")

#: After the daemon could not be reached, skip kvtier for this long.
RETRY_AFTER_SECONDS = 10.0


class KVTierStorage(HiCacheStorage):
    """One SGLang rank's link to the daemon: one session, the rank's namespace and layout."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        if storage_config.dcp_size > 1:
            raise ValueError("kvtier HiCache backend: decode context parallelism (dcp_size > 1) is not supported")
        self.storage_config = storage_config
        self.config = BackendConfig.from_extra(storage_config.extra_config, model_name=storage_config.model_name)
        self.scope = KeyScope.of(storage_config, self.config.salt)
        self.kv: KVTierClient | None = None
        self.pages: HostPages | None = None
        self._down_until = 0.0

    # -- set-up ------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take the host pool's layout and register it with the daemon; a layout the backend
        cannot page, or a daemon it cannot register with, fails SGLang's start with why."""
        super().register_mem_pool_host(mem_pool_host)
        pages = HostPages.of(mem_pool_host, mla=self.storage_config.is_mla_model)
        c = self.storage_config
        kv = self.config.client(f"sglang tp{c.tp_rank}/{c.tp_size} pid {os.getpid()}")
        try:
            kv.register(self.config.namespace, pages.layout)
        except KVTierError as exc:
            kv.close()
            raise RuntimeError(
                f"kvtier HiCache backend: cannot register namespace {self.config.namespace!r} with layout "
                f"{pages.layout} at {self.config.target}: {exc}. Is `kvtier serve` running there (extra config "
                "'target'), and does its token grant this namespace?"
            ) from exc
        self.kv, self.pages = kv, pages

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A hybrid model's side pools (Mamba states, sliding windows, indexers) travel through
        SGLang's v2 calls, which this backend does not implement: refused at attach."""
        if str(host_pool_name) != "kv":
            raise ValueError(f"kvtier HiCache backend: host pool {str(host_pool_name)!r} of a hybrid model is not "
                             "supported (only the KV pool); run this model without a storage backend")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def close(self) -> None:
        if self.kv is not None:
            self.kv.close()
            self.kv = None

    # -- the calls -----------------------------------------------------------------
    def _call(self, what: str, failed: T, call: Callable[[KVTierClient, HostPages], T]) -> T:
        """`call` with the client and the pool's pages, or `failed` when it cannot run or raises."""
        if self.kv is None or self.pages is None:
            log.warning("kvtier HiCache backend: %s before the host pool was registered", what)
            return failed
        if time.monotonic() < self._down_until:
            return failed
        try:
            return call(self.kv, self.pages)
        except Unavailable as exc:
            self._down_until = time.monotonic() + RETRY_AFTER_SECONDS
            log.warning("kvtier HiCache backend: %s: daemon unavailable (%s); not using kvtier for %.0fs",
                        what, exc, RETRY_AFTER_SECONDS)
        except Exception:  # noqa: BLE001 - SGLang's storage threads must not die of it: the page is recomputed
            log.exception("kvtier HiCache backend: %s failed", what)
        return failed

    def _keys(self, hashes: Sequence[str]) -> list[BlockKey]:
        return [self.scope.key(h) for h in hashes]

    def _parent(self, extra_info: HiCacheStorageExtraInfo | None) -> BlockKey | None:
        """The key of the page before the batch, for the daemon's KV events."""
        prefix = extra_info.prefix_keys if extra_info is not None else None
        return self.scope.key(prefix[-1]) if prefix else None

    def _host_pages(self, pages: HostPages, count: int, host_indices: torch.Tensor) -> list[torch.Tensor]:
        step = pages.page_tokens
        if host_indices.numel() != count * step:
            raise ValueError(f"{count} pages of {step} tokens need {count * step} host indices, "
                             f"got {host_indices.numel()}")
        return [pages.page(index) for index in host_indices[::step].tolist()]

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading keys the daemon holds, in any tier."""
        return self._call("batch_exists", 0, lambda kv, _: kv.lookup(self._keys(keys)).hit_blocks)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._call("batch_set_v1", [False] * len(keys), lambda kv, pages: store(
            kv, self._keys(keys), self._host_pages(pages, len(keys), host_indices), parent=self._parent(extra_info),
            batch=self.config.batch_pages))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._call("batch_get_v1", [False] * len(keys), lambda kv, pages: load(
            kv, self._keys(keys), self._host_pages(pages, len(keys), host_indices), batch=self.config.batch_pages))

    # -- the generic interface (flat data pages), without interface_v1 ----------------
    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return all(self._call("batch_set", [False], lambda kv, pages: store(
            kv, self._keys(keys), [pages.flat_page(v) for v in values], parent=None, batch=self.config.batch_pages)))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        done = self._call("batch_get", [False] * len(keys), lambda kv, pages: load(
            kv, self._keys(keys), [pages.flat_page(t) for t in target_locations], batch=self.config.batch_pages))
        return [target if ok else None for target, ok in zip(target_locations, done)]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def clear(self) -> bool:
        """kvtier drops pages by its own policy, never on a client's request: False."""
        log.warning("kvtier HiCache backend: clear() is not supported; kvtier evicts pages itself "
                    "(restart the daemon with an empty --cache-dir to start afresh)")
        return False
