#!/usr/bin/env bash
# Set up from nothing (tools/setup.sh), then run the whole test suite.
# Real-mount tests need root and /dev/fuse; elsewhere they skip and say why.
set -euo pipefail
# Root is needed (real-mount tests, tenant uids, installing packages): as root this runs
# as is; otherwise it runs itself again through sudo, and without sudo it says so.
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then exec sudo -E "$0" "$@"; fi
  echo "$(basename "$0"): run this as root (sudo is not installed)" >&2
  exit 1
fi
cd "$(dirname "$0")/.."
./tools/setup.sh
./tools/setup_vllm.sh  # .venv-vllm and the model, for tests/test_vllm.py
./tools/setup_engines.sh
exec .venv/bin/python -m pytest -q "$@"
