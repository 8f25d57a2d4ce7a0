#!/usr/bin/env bash
# Set everything up and run the demo: a throwaway daemon and one client round trip.
#   scripts/run.sh [kvtier demo options]     e.g. scripts/run.sh --prompt "hello, kv cache world"
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/kvtier demo "$@"
