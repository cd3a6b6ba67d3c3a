#!/usr/bin/env bash
# Set up from nothing (tools/setup.sh), then mount a demo kvfs with real KV blocks in it.
set -euo pipefail
# Root is needed (mounting with allow_other, installing packages): as root this runs as
# is; otherwise it runs itself again through sudo, and without sudo it says so.
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then exec sudo -E "$0" "$@"; fi
  echo "$(basename "$0"): run this as root (sudo is not installed)" >&2
  exit 1
fi
cd "$(dirname "$0")/.."
./tools/setup.sh
exec .venv/bin/kvfs demo "${1:-demo}"
