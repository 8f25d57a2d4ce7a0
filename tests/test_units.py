"""kvtier.units: sizes and durations in kvtier's own spelling and in Kubernetes' (8Gi, 1h30m),
and the config's parse_seconds reading durations through parse_duration."""
from __future__ import annotations

import pytest

from kvtier.server.config import ConfigError, load_config, parse_seconds
from kvtier.units import parse_duration, parse_size

GiB, MiB, KiB, TiB = 2**30, 2**20, 2**10, 2**40


@pytest.mark.parametrize("text, size", [
    ("8Gi", 8 * GiB), ("512Mi", 512 * MiB), ("100Ki", 100 * KiB), ("1Ti", TiB), ("2Pi", 2 * 2**50),
    ("1.5Gi", int(1.5 * GiB)), ("8gi", 8 * GiB),  # units are case-insensitive, as they always were
    ("8GiB", 8 * GiB), ("512MiB", 512 * MiB), ("256KiB", 256 * KiB), ("1TiB", TiB),
    ("8G", 8 * 10**9), ("8M", 8 * 10**6), ("8GB", 8 * 10**9), ("100k", 100_000), ("1.5GB", 1_500_000_000),
    ("4096", 4096), (" 16 MiB ", 16 * MiB), ("0", 0), (4096, 4096),
])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["8Gb2", "eight", "8 GiBs", "8Xi", "", "-1Gi", "1e3"])
def test_sizes_refused(text):
    with pytest.raises(ValueError, match=r"cannot read .* as a size; write e.g. 8GiB, 512MiB, 256KiB, 8Gi, 1.5GB or a byte count"):
        parse_size(text)


def test_a_negative_byte_count_is_refused():
    with pytest.raises(ValueError, match="a size must not be negative"):
        parse_size(-1)


@pytest.mark.parametrize("text, seconds", [
    ("1h", 3600.0), ("90m", 5400.0), ("30s", 30.0), ("500ms", 0.5), ("1h30m", 5400.0), ("2m30s", 150.0),
    ("300ms", 0.3), ("1.5h", 5400.0), ("100us", 0.0001), ("250µs", 0.00025), ("1500ns", 0.0000015),
    ("1h0m0s", 3600.0), ("5 s", 5.0), ("1h 30m", 5400.0), (".5s", 0.5),
    ("2", 2.0), ("0.5", 0.5), ("0", 0.0), (2, 2.0), (2.5, 2.5),
])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "", "1h30", "h", "1d", "5S", "1 hour", "-1s", "1h-30m", "ms500", "nan"])
def test_durations_refused(text):
    with pytest.raises(ValueError, match=r"cannot read .* as a duration; write e.g. 30s, 500ms, 5m, 1h30m"):
        parse_duration(text)


@pytest.mark.parametrize("value, message", [(-1, "a duration must not be negative"),
                                            (float("inf"), "cannot read inf as a duration")])
def test_numbers_of_seconds_refused(value, message):
    with pytest.raises(ValueError, match=message):
        parse_duration(value)


def test_parse_seconds_reads_through_parse_duration():
    assert parse_seconds("1h30m", "drain_timeout") == 5400.0
    assert parse_seconds("0", "warm_restart_window", zero=True) == 0.0
    with pytest.raises(ConfigError, match=r"^prefetch_hold: cannot read 'soon' as a duration; write e\.g\. 30s"):
        parse_seconds("soon", "prefetch_hold")
    with pytest.raises(ConfigError, match=r"^session_timeout: duration must be positive$"):
        parse_seconds("0s", "session_timeout")


def test_the_daemon_config_takes_kubernetes_spellings(tmp_path):
    env = {"KVTIER_HOST_SIZE": "2Gi", "KVTIER_DISK_SIZE": "1Ti", "KVTIER_WARM_RESTART_WINDOW": "1h",
           "KVTIER_SOCKET": str(tmp_path / "s.sock")}
    cfg = load_config(None, env, {"drain_timeout": "2m30s", "cluster_timeout": "750ms"})
    assert cfg.tiers.host_size == 2 * GiB and cfg.tiers.disk_size == TiB
    assert cfg.tiers.warm_restart_window == 3600.0 and cfg.sessions.drain_timeout == 150.0
    assert cfg.cluster.timeout == 0.75
