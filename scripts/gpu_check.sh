#!/usr/bin/env bash
# On a GPU machine: run every GPU test (kernels against their CPU references, among them the
# vLLM block <-> page kernel with device and pinned host pages, whose bandwidth against one
# cudaMemcpyAsync of the same bytes it prints (issue 26's target: >= 0.8x), the copy
# engine's promote/demote integrity over both device arenas, the round trip between a real
# daemon and a client process, device memory per namespace: tenant B's process cannot read
# tenant A's device pages, and promotion over it is as fast as over one allocation), then
# print the bandwidth tables last (the copy engine's table runs over memory per namespace
# where the GPU supports it: compare with docs/gpu.md's figures for regressions).
#   scripts/gpu_check.sh [pytest args]
# Needs numpy, pytest, torch and CuPy for the local CUDA (pip install -e '.[gpu]'). Exits 2
# with a message without a GPU. Works without the project's venv: a typical GPU image lacks
# lmdb, xxhash and grpc's health/reflection packages; scripts/gpu_wheels.sh downloads them
# into .whl/ beforehand, and they are installed from there into /tmp/kvtier-site. Without
# lmdb the daemon in the IPC test runs without a disk tier.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvtier-site .whl/*.whl
  export PYTHONPATH="/tmp/kvtier-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:$PWD/client:$PWD/benchmarks:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c 'import sys; from kvtier_client.kernels import is_available; sys.exit(0 if is_available() else 1)'; then
  echo "gpu_check: no GPU here (needs CuPy importable and a CUDA device); nothing run" >&2
  exit 2
fi
# CuPy compiles kernels with NVRTC: fail here, clearly, if it is missing.
"$PYTHON" -c 'import cupy; assert int(cupy.arange(3).sum()) == 3' || { echo "gpu_check: CuPy cannot compile kernels (NVRTC missing?)" >&2; exit 1; }
# -o addopts= : the project's defaults deselect gpu tests and need pytest-timeout.
# The tables are printed even when a test fails; the exit status is the tests' (or the bench's).
status=0
"$PYTHON" -m pytest -o addopts= --noconftest -p no:cacheprovider -m gpu -q -rsP \
  tests/client/test_kernels_gpu.py tests/client/test_kernels_vllm.py tests/mechanism/test_device_gpu.py \
  tests/mechanism/test_device_isolation_gpu.py "$@" || status=$?
"$PYTHON" -m kvtier_bench.gpu || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
exit "$status"
