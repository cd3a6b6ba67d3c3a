#!/usr/bin/env bash
# Set up from nothing (tools/setup.sh), then run the whole test suite.
# Real-mount tests need root and /dev/fuse; elsewhere they skip and say why.
set -euo pipefail
cd "$(dirname "$0")/.."
./tools/setup.sh
./tools/setup_engines.sh
exec .venv/bin/python -m pytest -q "$@"
