"""`kvtier serve` start-up: configurations it refuses (one line on stderr, exit code 2, no
traceback), what it takes over (a stale socket), and config precedence
(TOML < KVTIER_* environment < flags)."""
from __future__ import annotations

import socket
import subprocess

import pytest

from kvtier_client import kernels
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import run_kvtier, tier_stats


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_refused(result: subprocess.CompletedProcess, *words: str) -> str:
    """Exit code 2, and exactly one line on stderr naming the problem."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, f"exit {result.returncode}, stderr:\n{result.stderr}"
    assert len(lines) == 1 and lines[0].startswith("kvtier serve: "), f"not one line:\n{result.stderr}"
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


def serve_args(tmp_path, *args: str) -> list[str]:
    return ["serve", "--socket", str(tmp_path / "run" / "kvtier.sock"), "--cache-dir", str(tmp_path / "cache"),
            "--host-size", "1MiB", "--disk-size", "4MiB", "--arena-prefix", "kvtier-test-refused", *args]


REFUSALS = {
    # name: (extra args, or a function of tmp_path giving them; words the message must contain)
    "cache dir under a file": (lambda p: ["--cache-dir", str(p / "plain-file" / "cache")], ["cache_dir", "Not a directory"]),
    "host size over free RAM": (["--host-size", "100TiB"], ["host_size", "lower --host-size"]),
    "disk size over free disk": (["--disk-size", "100TiB"], ["disk_size", "lower --disk-size"]),
    "tcp without tls": (lambda p: ["--tcp", f"127.0.0.1:{free_port()}"], ["tcp", "--insecure"]),
    "tcp port out of range": (["--tcp", "127.0.0.1:70000", "--insecure"], ["tcp", "65535"]),
    "malformed size": (["--host-size", "8XB"], ["host_size", "'8XB'"]),
    "unknown config key": (lambda p: ["--config", str(p / "bad.toml")], ["unknown key 'host_sise'"]),
    "socket path too long": (lambda p: ["--socket", str(p / ("x" * 120) / "kvtier.sock")], ["socket path", "shorter"]),
}
if not kernels.is_available():
    REFUSALS["device tier without a gpu"] = (["--device-size", "1GiB"], ["device_size", "CUDA", "device_size 0"])


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refuses_unusable_config(tmp_path, case):
    (tmp_path / "plain-file").write_text("not a directory")
    (tmp_path / "bad.toml").write_text('host_sise = "1MiB"\n')
    extra, words = REFUSALS[case]
    result = run_kvtier(*serve_args(tmp_path, *(extra(tmp_path) if callable(extra) else extra)))
    assert_refused(result, *words)
    assert not (tmp_path / "run" / "kvtier.sock").exists()


def test_refuses_what_a_live_daemon_holds(daemons, connect):
    tcp, metrics = free_port(), free_port()
    live = daemons.start("--tcp", f"127.0.0.1:{tcp}", "--insecure", "--metrics-port", str(metrics))
    base = live.socket.parent.parent

    # The same socket, the same TCP port, the same metrics port: each refused, cleanly.
    same_socket = run_kvtier(*serve_args(base / "second"), "--socket", str(live.socket))
    assert_refused(same_socket, "another kvtier daemon is serving", str(live.socket))
    same_tcp = run_kvtier(*serve_args(base / "third"), "--tcp", f"127.0.0.1:{tcp}", "--insecure")
    assert_refused(same_tcp, "tcp", "in use")
    same_metrics = run_kvtier(*serve_args(base / "fourth"), "--metrics-port", str(metrics))
    assert_refused(same_metrics, "metrics_port", "in use")

    # The live daemon was not disturbed.
    assert live.proc.poll() is None and live.socket.exists()
    assert connect(live.target).register("still-here").session_id


def test_replaces_a_stale_socket(daemons, tmp_path, connect):
    path = tmp_path / "d" / "run" / "kvtier.sock"
    path.parent.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))  # bound, never served: what a crashed daemon leaves behind
    stale.close()
    assert path.is_socket()
    d = daemons.start()  # start_daemon waits for SERVING on that very path
    assert d.socket == path
    assert connect(d.target).register("after-stale").session_id
    assert "replacing stale socket" in d.log()


def test_config_precedence(daemons, tmp_path, connect):
    config = tmp_path / "kvtier.toml"
    cache = tmp_path / "d" / "cache"
    config.write_text(f'cache_dir = "{cache}"\nhost_size = "1MiB"\ndisk_size = "1MiB"\nsession_timeout = "1s"\n')
    env = {"KVTIER_CONFIG": str(config), "KVTIER_DISK_SIZE": "2MiB", "KVTIER_SESSION_TIMEOUT": "2s"}
    d = daemons.serve("--session-timeout", "3s", env=env)
    conn = connect(d.target)
    reply = conn.register("precedence")
    capacities = {t.tier: t.capacity_pages for t in reply.tiers}
    assert capacities == {pb.TIER_HOST: 256, pb.TIER_DISK: 512}  # host from TOML, disk from the environment
    assert reply.session_timeout_ms == 3000  # the flag beats both
    state = conn.state()
    assert tier_stats(state, reply.pool_id, pb.TIER_HOST).capacity_pages == 256
    assert tier_stats(state, reply.pool_id, pb.TIER_DISK).capacity_pages == 512
    assert (cache / reply.pool_id / "slab.bin").exists()  # cache_dir from TOML too

