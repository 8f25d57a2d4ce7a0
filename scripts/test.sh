#!/usr/bin/env bash
# Set everything up and run the whole default test suite (no GPU needed).
#   scripts/test.sh [pytest args]     e.g. scripts/test.sh -k disk
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/gen_proto.sh --check
exec .venv/bin/python -m pytest -q "$@"
