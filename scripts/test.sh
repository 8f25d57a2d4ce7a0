#!/usr/bin/env bash
# Set everything up and run the whole default test suite (no GPU needed).
#   scripts/test.sh [pytest args]     e.g. scripts/test.sh -k disk
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/setup_vllm.sh   # .venv-vllm for the vLLM connector's end-to-end test (a few minutes, once)
scripts/setup_sglang.sh  # .venv-sglang for the SGLang HiCache backend's test (about a minute, once)
scripts/gen_proto.sh --check
.venv/bin/python scripts/gen_values_schema.py --check   # deploy/helm/kvtier/values.schema.json
# Byte-compile the project once: tests start hundreds of daemons and clients, and where
# PYTHONDONTWRITEBYTECODE is set (as on CI) each would compile every module again (~0.7 s).
.venv/bin/python -m compileall -q -j 0 kvtier client/kvtier_client benchmarks/kvtier_bench tests >/dev/null
# On every core (pytest-xdist): most tests wait on daemons. A module's tests stay on one worker
# (--dist loadfile), so a module-scoped daemon or vLLM run is made once. `-n 0` runs serially.
exec .venv/bin/python -m pytest -q -n auto --dist loadfile --durations=30 "$@"
