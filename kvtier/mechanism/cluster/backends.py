"""The cluster tier's stores by the scheme of their URL: `open_backend` makes the
RemoteStore a URL names, `check_url` reads one without connecting (configuration).

A backend is a store class taking (url, *, username, password, tls_ca, timeout) that
connects lazily, and the parser of its URLs; a second one is one more line in `BACKENDS`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier.mechanism.cluster.redis import SCHEMES as REDIS_SCHEMES
from kvtier.mechanism.cluster.redis import ClusterAddress, RedisClusterStore
from kvtier.mechanism.cluster.remote import RemoteStore


@dataclass(frozen=True)
class Backend:
    open: Callable[..., RemoteStore]  # (url, *, username, password, tls_ca, timeout); connects on first use
    check: Callable[[str], object]  # reads a URL; ValueError saying what is wrong with it


BACKENDS: dict[str, Backend] = dict.fromkeys(REDIS_SCHEMES, Backend(RedisClusterStore, ClusterAddress.parse))


def backend_of(url: str) -> Backend:
    """The backend of `url`'s scheme; ValueError naming the known ones (never the URL: it may
    hold a password)."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in BACKENDS:
        known = ", ".join(f"{s}://" for s in BACKENDS)
        raise ValueError(f"cluster address must start with one of {known} (got {scheme + sep if sep else 'no scheme'})")
    return BACKENDS[scheme]


def check_url(url: str) -> None:
    """Refuse (ValueError) a URL no backend can use, without connecting."""
    backend_of(url).check(url)


def open_backend(url: str, *, username: str | None = None, password: str | None = None, tls_ca: str | None = None,
                 timeout: float = 1.0) -> RemoteStore:
    """The store `url` names; `username`/`password` override the URL's, `tls_ca` is the PEM CA
    of a TLS scheme, `timeout` bounds every socket operation."""
    return backend_of(url).open(url, username=username, password=password, tls_ca=tls_ca, timeout=timeout)
