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
if [ "$#" -gt 0 ]; then exec .venv/bin/python -m pytest -q "$@"; fi
.venv/bin/python -m pytest -q
# The fallback door: the same mount tests again with the daemon serving every byte, as it
# does where the kernel or the privileges refuse FUSE passthrough (the engines' own tests
# and `kvfs bench serve` start their mounts themselves and ran above).
echo "tools/test.sh: the mount tests again with --no-passthrough"
KVFS_TEST_MOUNT_ARGS=--no-passthrough exec .venv/bin/python -m pytest -q -m mount \
  --ignore=tests/test_vllm.py --ignore=tests/test_sglang.py --ignore=tests/test_lmcache.py \
  --ignore=tests/test_engines.py --ignore=tests/test_integrations.py \
  --ignore=tests/test_bench_serve.py
