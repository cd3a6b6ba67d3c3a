#!/usr/bin/env bash
# Build ./.venv-engines: SGLang 0.5.23 and LMCache 0.5.6 beside kvfs, for the tests and the
# benchmark of kvfs's storage backends for both engines (kvfs/integrations/sglang.py and
# lmcache.py). Idempotent: a second run only checks.
#
# Both engines are installed without their dependencies (their full dependency sets pull CUDA
# builds of several GB); the list below is exactly what importing the classes the backends,
# tests and benchmark use requires (SGLang's storage backend factory and host KV pools,
# LMCache's storage manager and local disk backend), pinned. torch comes first, as the CPU
# build (an unpinned torch would pull a CUDA build). Kept apart from .venv: other work shares it.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-engines
TORCH=torch==2.13.0
ENGINES=(sglang==0.5.23 lmcache==0.5.6)
DEPS=(
  aiofile==3.12.3 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0
  annotated-types==0.8.0 anyio==4.16.0 apache-tvm-ffi==0.1.15.post2 attrs==26.1.0
  cachetools==8.0.2 caio==0.12.10 certifi==2026.10.19.post1 cffi==2.1.1
  compressed-tensors==0.20.1 cryptography==50.0.2 dill==0.4.1 frozenlist==1.8.0
  gguf==0.19.0 h11==0.16.0 httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0
  idna==3.20 ipython==9.18.1 llvmlite==0.50.0 loguru==0.7.3 msgspec==0.23.0
  multidict==7.2.1 numba==0.68.1 numpy==2.4.6 orjson==3.13.0 packaging==26.4
  pillow==13.0.0 prometheus_client==0.26.0 propcache==0.5.4 psutil==7.2.2
  py-cpuinfo==9.0.0 pybase64==1.5.1 pycparser==3.12 pydantic==2.14.4
  pydantic_core==2.50.5 Pygments==2.21.0 PyYAML==6.0.4 pyzmq==27.3.0
  regex==2026.11.19 requests==2.34.2 safetensors==0.8.0 sentencepiece==0.2.3
  sortedcontainers==2.4.0 starlette==1.10.0 tokenizers==0.23.3 torchvision==0.28.0
  tqdm==4.70.1 traitlets==5.16.1 transformers==5.24.0 triton==3.9.0 truststore==0.10.5
  typing-inspection==0.4.5 urllib3==2.8.0 yarl==1.25.1
  xxhash==4.1.0
)
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup_engines: creating $VENV"
  "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/pip" install -q --disable-pip-version-check)
have() { "$VENV/bin/python" - "$@" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
want = [a.split("==") for a in sys.argv[1:]]
try:
    bad = [n for n, v in want if version(n).split("+")[0] != v]
except PackageNotFoundError:
    sys.exit(1)
sys.exit(1 if bad else 0)
EOF
}
if ! have "$TORCH"; then
  echo "setup_engines: installing $TORCH (CPU build)"
  "${pip[@]}" "$TORCH"
fi
if ! have "${ENGINES[@]}" "${DEPS[@]}"; then
  echo "setup_engines: installing ${ENGINES[*]} and what their imports need"
  "${pip[@]}" --no-deps "${ENGINES[@]}" "${DEPS[@]}"
fi
# Installed (editable) from this checkout: checked from another directory, where the
# checkout is not on the path by itself.
root=$PWD
if ! (cd / && "$root/$VENV/bin/python" -c 'import os, sys, kvfs.client
sys.exit(os.path.dirname(kvfs.__file__) != sys.argv[1])' "$root/kvfs") 2>/dev/null; then
  echo "setup_engines: installing kvfs (editable)"
  "${pip[@]}" --no-deps -e .
fi
# The check that counts: the engines' own classes import in this venv.
"$VENV/bin/python" -m kvfs.integrations.drive check 2>/dev/null | tail -1
