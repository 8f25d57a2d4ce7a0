"""The cluster tier's backends by the scheme of their URL: `open_backend` makes the
RemoteStore a URL names, `check_url` reads one without connecting (configuration).

`BACKENDS` is the one list of them (kvtier.registry): Redis and Valkey Cluster are built
in; a backend from outside kvtier is an entry point in the group `kvtier.cluster_backends`
named by its scheme (`mooncake = "kvtier_mooncake:BACKEND"`), naming an object that
provides ClusterBackend (kvtier.mechanism.cluster.remote). A URL's scheme picks it, so no
option names a backend, and there is no module-path door here: a scheme cannot spell one.
"""
from __future__ import annotations

from kvtier.mechanism.cluster.redis import REDIS, SCHEMES
from kvtier.mechanism.cluster.remote import ClusterBackend, RemoteStore, StoreSettings
from kvtier.registry import Registry, RegistryError


def _admit(scheme: str, backend: ClusterBackend) -> None:
    """Check a backend from outside kvtier: it reads URLs and opens stores."""
    missing = [m for m in ("check", "open") if not callable(getattr(backend, m, None))]
    if missing:
        raise RegistryError(f"cluster backend {scheme!r} ({backend!r}) has no {' or '.join(missing)} method "
                            "(kvtier.mechanism.cluster.remote.ClusterBackend says what one provides)")


#: Every cluster backend, by URL scheme: the built-in ones, then those from outside kvtier.
BACKENDS: Registry[ClusterBackend] = Registry(
    "cluster backend", "kvtier.cluster_backends", 'docs/tiers.md, "Adding a cluster backend"',
    dict.fromkeys(SCHEMES, REDIS), module_paths=False, admit=_admit)


def backend_of(url: str) -> ClusterBackend:
    """The backend of `url`'s scheme; ValueError naming the known ones (never the URL: it may
    hold a password)."""
    scheme, sep, _ = url.partition("://")
    if sep and scheme in BACKENDS.names():
        return BACKENDS[scheme]  # a plugin's that does not load says why
    known = ", ".join(f"{s}://" for s in BACKENDS.names())
    raise ValueError(f"cluster address must start with one of {known} (got {scheme + sep if sep else 'no scheme'}). "
                     f"{BACKENDS.how_to_add()}")


def check_url(url: str) -> None:
    """Refuse (ValueError) a URL no backend can use, without connecting."""
    backend_of(url).check(url)


def open_backend(url: str, *, username: str | None = None, password: str | None = None, tls_ca: str | None = None,
                 timeout: float = 1.0) -> RemoteStore:
    """The store `url` names; `username`/`password` override the URL's, `tls_ca` is the PEM CA
    of a TLS scheme, `timeout` bounds every operation (StoreSettings)."""
    return backend_of(url).open(url, StoreSettings(username, password, tls_ca, timeout))
