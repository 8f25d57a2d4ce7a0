#!/usr/bin/env bash
# Create .venv-sglang: SGLang 0.5.23's Python code (installed --no-deps) on torch==2.13.0 CPU,
# the small packages its storage modules import, and an editable kvtier-client, for the
# HiCache storage backend (client/kvtier_client/integrations/sglang/) and its test
# (tests/integrations/test_sglang_backend.py).
# SGLang's own requirements pull a CUDA torch and its kernels (several GB); the storage
# interface (sglang.srt.mem_cache.hicache_storage, storage.backend_factory) needs none of
# them, only what `import sglang` imports on the way. triton is among those (imported by
# sglang.srt.utils, never run here). Versions are pinned to the set this was tested with.
# A second run installs nothing unless this script or client/pyproject.toml changed (stamp in
# .venv-sglang).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${KVTIER_SGLANG_VENV:-.venv-sglang}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
stamp=$VENV/.kvtier-setup-sglang
want=$(cat scripts/setup_sglang.sh client/pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "setting up $VENV (torch==2.13.0 CPU, sglang==0.5.23 without its deps, kvtier-client)..." >&2
pip="$VENV/bin/python -m pip"
$pip install -q --upgrade pip
$pip install -q 'torch==2.13.0' 'numpy==2.4.6'
# What `import sglang.srt.mem_cache.hicache_storage` imports, and nothing it does not (SGLang's
# other requirements stay missing on purpose: --no-warn-conflicts).
$pip install -q --no-deps --no-warn-conflicts 'sglang==0.5.23' 'triton==3.9.0' \
  'orjson==3.13.0' 'psutil==7.2.2' 'pybase64==1.5.1' 'packaging==26.4' 'pillow==13.0.0' \
  'requests==2.34.2' 'charset-normalizer==3.5.3' 'urllib3==2.8.0' 'idna==3.20' 'certifi==2026.10.19.post1' \
  'starlette==1.10.0' 'anyio==4.16.0' 'msgspec==0.23.0' 'pyzmq==27.3.0' 'tqdm==4.70.1' \
  'pydantic==2.14.4' 'pydantic_core==2.50.5' 'typing-inspection==0.4.5' \
  'ipython==9.18.1' 'traitlets==5.16.1' 'Pygments==2.21.0' \
  'aiohttp==3.14.5' 'aiohappyeyeballs==2.7.1' 'aiosignal==1.4.0' 'attrs==26.1.0' 'frozenlist==1.8.0' \
  'multidict==7.2.1' 'propcache==0.5.4' 'yarl==1.25.1' \
  'transformers==5.19.0' 'tokenizers==0.23.2' 'safetensors==0.8.0' 'huggingface_hub==2.4.0' \
  'regex==2026.11.19' 'PyYAML==6.0.4' 'httpx2==2.16.2' 'httpcore2==2.16.2' 'h11==0.16.0' 'truststore==0.10.5'
$pip install -q --no-warn-conflicts -e ./client 'torch==2.13.0'
"$VENV/bin/python" - <<'PY'
import grpc, torch, kvtier_client
import sglang.srt.mem_cache.hicache_storage, sglang.srt.mem_cache.storage.backend_factory
from importlib.metadata import version
print("sglang", version("sglang"), "torch", torch.__version__, "grpcio", grpc.__version__)
PY
echo "$want" >"$stamp"
