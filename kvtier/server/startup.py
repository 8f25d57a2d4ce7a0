"""Before the daemon serves: probe the machine for what the configuration asks (memory, disk,
GPU, ports, certificates) and claim the cache directory and the socket path for this process
(`Claims`). Each refusal is a ConfigError whose one line says what to change; `kvtier serve`
prints it and exits 2."""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import stat

import grpc

from kvtier.mechanism.device import cuda_device_count
from kvtier.mechanism.disk_meta import check_cache_dir
from kvtier.server.config import ConfigError, DaemonConfig, ListenConfig, TiersConfig
from kvtier.server.handoff import handoff_path

log = logging.getLogger(__name__)


class Claims:
    """What makes this process the one daemon of its cache directory and of its socket: an
    exclusive `flock` on a lock file in each (`.kvtier.lock` in cache_dir, `<socket>.lock`
    beside the socket), taken without waiting, the holder's pid written into it.

    Held for the daemon's whole life. The OS drops a flock when its process ends, however it
    ends, so a killed daemon's directory and socket are free again at once: no stale lock to
    clean up, no pid to check for liveness. `release()` comes only after a clean stop has
    closed the pools and removed the socket file, so whoever takes a lock next finds the
    directory closed and any socket file there stale. The lock files stay: unlinking one that
    another process has open would let two processes each lock a different file of one name.
    """

    CACHE_DIR_LOCK = ".kvtier.lock"
    SOCKET_LOCK_SUFFIX = ".lock"

    def __init__(self) -> None:
        self._held: list[int] = []  # descriptors of the locked files, in the order taken

    def take(self, path: str) -> str | None:
        """Lock `path` (created if missing) for this process and write our pid into it. None
        when taken; when another process holds it, the pid it wrote ('' if not yet written)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ConfigError(f"cannot open the lock file {path} ({exc.strerror}); remove it or fix its permissions") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            return owner if owner.isdigit() else ""
        self._held.append(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return None

    def release(self) -> None:
        """Drop every lock, newest first (the socket before the cache directory)."""
        while self._held:
            fd = self._held.pop()
            os.ftruncate(fd, 0)  # a later refusal must not name a pid that is gone
            os.close(fd)  # the only descriptor of that open file: closing it drops the flock


def preflight(cfg: DaemonConfig) -> Claims:
    """Refuse a configuration that cannot work, with a one-line reason (ConfigError); claim the
    cache directory (when there is a disk tier) and the socket. The caller keeps the claims
    until the daemon has stopped."""
    claims = Claims()
    try:
        _check_and_claim(cfg, claims)
    except BaseException:
        claims.release()
        raise
    return claims


def _check_and_claim(cfg: DaemonConfig, claims: Claims) -> None:
    listen, tiers = cfg.listen, cfg.tiers
    if listen.tls_cert:
        tls_credentials(listen)  # unreadable files fail now, not at bind time
    try:
        os.makedirs(tiers.cache_dir, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cache_dir {tiers.cache_dir}: cannot create it ({exc.strerror})") from None
    if not os.access(tiers.cache_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"cache_dir {tiers.cache_dir} is not writable by this user; choose another with --cache-dir")
    if tiers.disk_size:  # before anything in it is opened; without a disk tier nothing ever is
        owner = claims.take(os.path.join(tiers.cache_dir, Claims.CACHE_DIR_LOCK))
        if owner is not None:
            raise ConfigError(
                f"cache_dir {tiers.cache_dir} is in use by another kvtier daemon{_pid(owner)}; "
                "stop it first or choose another --cache-dir"
            )
        check_cache_dir(tiers.cache_dir)  # a newer kvtier's disk tier: FormatRefused, exit 2
    available = _mem_available()
    if available is not None and tiers.host_size > available:
        raise ConfigError(f"host_size {tiers.host_size >> 20} MiB exceeds available RAM ({available >> 20} MiB); lower --host-size")
    if tiers.disk_size:
        free = shutil.disk_usage(tiers.cache_dir).free + _existing_slabs(tiers.cache_dir)
        if tiers.disk_size > free:
            raise ConfigError(
                f"disk_size {tiers.disk_size >> 20} MiB exceeds the free space under {tiers.cache_dir} ({free >> 20} MiB); "
                "lower --disk-size or choose another --cache-dir"
            )
    if tiers.device_size:
        _check_device(tiers)
    if listen.tcp:
        _check_port(listen.tcp, "tcp")
    if cfg.metrics.port:
        _check_port(f"{cfg.metrics.host}:{cfg.metrics.port}", "metrics_port")
    _claim_socket(listen.socket, claims)


def tls_credentials(listen: ListenConfig) -> grpc.ServerCredentials:
    """The TCP listener's credentials from its PEM files (mutual TLS with tls_client_ca)."""
    def read(path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror}") from None

    client_ca = read(listen.tls_client_ca) if listen.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(read(listen.tls_key), read(listen.tls_cert))], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def _check_device(tiers: TiersConfig) -> None:
    count = cuda_device_count()
    if not count:
        raise ConfigError(
            "device_size needs a CUDA GPU and CuPy (pip install 'kvtier[gpu]'); none found: "
            "set device_size 0 for host and disk tiers only"
        )
    import cupy

    if tiers.gpu >= count:
        raise ConfigError(f"gpu {tiers.gpu} does not exist: this machine has {count} CUDA device(s) (0..{count - 1})")
    with cupy.cuda.Device(tiers.gpu):
        free, _ = cupy.cuda.runtime.memGetInfo()
    if tiers.device_size > free:
        raise ConfigError(f"device_size {tiers.device_size >> 20} MiB exceeds the free memory of GPU {tiers.gpu} ({free >> 20} MiB)")


def _check_port(address: str, key: str) -> None:
    """Refuse a TCP address this daemon cannot listen on (in use, not local, unresolvable)."""
    host, _, port = address.rpartition(":")
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host.strip("[]") or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the real listener does
            probe.bind(sockaddr)
    except OSError as exc:
        raise ConfigError(
            f"{key}: cannot listen on {address} ({exc.strerror or exc}); stop what holds it or choose another port"
        ) from None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _existing_slabs(cache_dir: str) -> int:
    """Space our own slab files already take: reusing them needs no new space."""
    total = 0
    for entry in os.scandir(cache_dir):
        slab = os.path.join(entry.path, "slab.bin")
        if entry.is_dir() and os.path.exists(slab):
            total += os.path.getsize(slab)
    return total


_SUN_PATH_MAX = 108  # sizeof(sockaddr_un.sun_path) on Linux, terminating NUL included


def _claim_socket(path: str, claims: Claims) -> None:
    """Create the socket's directory and take the socket's lock; then any socket file at `path`
    is stale (its daemon died, or stopped before removing it) and is replaced."""
    _check_socket_path(handoff_path(path), "--socket (the handoff socket beside it adds 8 bytes)")
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o770, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"socket directory {directory}: cannot create it ({exc.strerror})") from None
    owner = claims.take(path + Claims.SOCKET_LOCK_SUFFIX)
    if owner is not None:
        raise ConfigError(f"another kvtier daemon is serving {path}{_pid(owner)}; stop it first or choose another --socket")
    if not os.path.lexists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise ConfigError(f"{path} exists and is not a socket; remove it or choose another --socket")
    log.info("replacing stale socket", extra={"socket": path})
    os.unlink(path)


def _check_socket_path(path: str, option: str) -> None:
    if len(os.fsencode(path)) >= _SUN_PATH_MAX:
        raise ConfigError(
            f"socket path {path} is {len(os.fsencode(path))} bytes; Unix sockets allow at most {_SUN_PATH_MAX - 1}: "
            f"choose a shorter {option}"
        )


def _pid(owner: str) -> str:
    return f" (pid {owner})" if owner else ""
