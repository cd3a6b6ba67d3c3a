#!/usr/bin/env bash
# Set up from nothing (tools/setup.sh), then mount a demo kvfs with real KV blocks in it.
set -euo pipefail
cd "$(dirname "$0")/.."
./tools/setup.sh
exec .venv/bin/kvfs demo "${1:-demo}"
