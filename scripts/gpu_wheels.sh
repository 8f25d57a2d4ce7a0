#!/usr/bin/env bash
# Download the wheels a bare GPU image lacks (for Python 3.12, x86-64 manylinux) into .whl/,
# which scripts/gpu_check.sh installs from. Run here, before carrying .whl to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
PY=${PY_VERSION:-3.12}
for spec in grpcio==1.85.3 protobuf==7.36.2 lmdb xxhash grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 pytest pluggy iniconfig packaging pytest-timeout; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$spec" || python3 -m pip download -q --no-deps -d .whl "$spec"
done
ls -la .whl
