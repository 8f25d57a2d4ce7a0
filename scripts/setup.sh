#!/usr/bin/env bash
# Create .venv and install kvtier, its client, its benchmarks (kvtier-bench, benchmarks/) and
# the test tools from this checkout.
# Torch is the pinned CPU build (torch==2.13.0). A second run installs nothing unless a
# pyproject.toml changed (the stamp in .venv records what was installed). Debian's
# redis-server, for the cluster tier's tests, comes from scripts/setup_redis.sh (as root with
# apt-get; a no-op when it is there), checked on every run since the stamp does not cover it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_redis.sh
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.kvtier-setup
want=$(cat pyproject.toml client/pyproject.toml benchmarks/pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "setting up .venv (kvtier, kvtier-client, kvtier-bench, test tools, torch==2.13.0 CPU)..." >&2
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ./client -e '.[dev]' -e ./benchmarks 'torch==2.13.0'
echo "$want" >"$stamp"
