#!/usr/bin/env bash
# Create .venv and install kvtier, its client and the test tools from this checkout.
# Idempotent: a second run only checks. Torch is the pinned CPU build (torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ./client -e '.[dev]' 'torch==2.13.0'
