#!/usr/bin/env bash
# Make sure a `redis-server` is on PATH: the cluster tier's tests and `kvtier bench cluster`
# start a loopback Redis Cluster of them (benchmarks/kvtier_bench/redis_cluster.py). Installs
# Debian's redis-server (7.0, with redis-cli) when it is missing and this is root with apt-get;
# otherwise it does nothing and those tests skip, saying so. Quiet, and instant when
# redis-server (or valkey-server) is already there. SKIP_APT=1 never calls apt-get.
# scripts/setup.sh calls it on every run, so a clean clone (CI) gets the server too.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1; then
  exit 0
fi
if [ -n "${SKIP_APT:-}" ] || ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
  exit 0
fi
echo "setup_redis: apt-get install redis-server (for the cluster tier's tests and benchmark)" >&2
install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1; }
# A fresh image may have no package lists yet: update only when the first try fails.
if ! install && ! { apt-get update -qq >/dev/null 2>&1 && install; }; then
  echo "setup_redis: could not install redis-server; the cluster tests will skip (apt-get install redis-server)" >&2
  exit 0
fi
