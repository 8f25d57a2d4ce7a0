#!/usr/bin/env bash
# On a GPU machine: run the GPU tests, then print the page-copy bandwidth table last.
#   scripts/gpu_check.sh [pytest args]
# Needs numpy, pytest and CuPy for the local CUDA (pip install -e '.[gpu]'); exits 2 with a
# message without a GPU. Works without the project's venv and without lmdb (a typical GPU
# image lacks it): the GPU tests need neither the disk tier nor the shared test fixtures.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD:$PWD/client${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c 'import sys; from kvtier.mechanism.kernels import is_available; sys.exit(0 if is_available() else 1)'; then
  echo "gpu_check: no GPU here (needs CuPy importable and a CUDA device); nothing run" >&2
  exit 2
fi
# -o addopts= : the project's defaults deselect gpu tests and need pytest-timeout.
"$PYTHON" -m pytest -o addopts= --noconftest -p no:cacheprovider -m gpu -q -rs tests/mechanism/test_kernels_gpu.py "$@"
"$PYTHON" -m kvtier.bench.gpu
