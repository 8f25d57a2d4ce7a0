"""The cluster tier's store is the one its URL's scheme names (kvtier.mechanism.cluster.backends)."""
from __future__ import annotations

import pytest

from kvtier.mechanism.cluster import RedisClusterStore, check_url, open_backend
from kvtier.server.config import ConfigError, load_config


@pytest.mark.parametrize("url, tls", [
    ("redis://10.0.0.5:6379,10.0.0.6:6379", False), ("rediss://10.0.0.5:6379", True),
    ("valkey://10.0.0.5:6379", False), ("valkeys://10.0.0.5:6379", True),
])
def test_a_redis_or_valkey_url_opens_the_redis_cluster_store(url, tls):
    store = open_backend(url, password="pw", timeout=0.5)  # connects on first use: nothing listens there
    try:
        assert isinstance(store, RedisClusterStore)
        assert store.address.nodes[0] == ("10.0.0.5", 6379) and store.address.tls is tls
    finally:
        store.close()


@pytest.mark.parametrize("url", ["mooncake://user:secret@10.0.0.5:50051", "10.0.0.5:6379", ""])
def test_an_unknown_scheme_is_refused_naming_the_known_ones(url):
    for call in (check_url, open_backend):
        with pytest.raises(ValueError) as refused:
            call(url)
        message = str(refused.value)
        assert all(f"{scheme}://" in message for scheme in ("redis", "rediss", "valkey", "valkeys")), message
        assert "secret" not in message  # a URL may carry a password: never echoed


def test_the_configuration_refuses_an_unknown_scheme_before_the_daemon_starts():
    with pytest.raises(ConfigError, match=r"cluster: .*redis://, rediss://, valkey://, valkeys://.* \(got http://\)"):
        load_config(None, {}, {"cluster": "http://10.0.0.5:6379"})


def test_a_known_scheme_with_a_bad_address_is_refused_by_its_backend():
    with pytest.raises(ValueError, match="is not host:port"):
        check_url("redis://10.0.0.5")


def test_the_store_a_url_opens_keeps_pages_on_a_real_cluster(redis_cluster):
    store = open_backend(redis_cluster.url, timeout=5.0)
    try:
        assert store.put([(b"k", (b"header", b"page"))]) == [True]
        assert store.get([b"k", b"absent"]) == [(b"header", b"page"), None]
    finally:
        store.close()
