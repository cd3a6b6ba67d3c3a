#!/usr/bin/env bash
# Install everything kvfs needs on a fresh Debian/Ubuntu machine, from nothing:
# the FUSE 3 packages (fusermount3, and libfuse3-dev + pkg-config to build pyfuse3), the xxhash
# header (libxxhash-dev: kvfs's C modules, kvfs/client/_fastread.c and
# kvfs/daemon/_passthrough.c), libzstd-dev (the block codec, kvfs/format/_codec.c), libssl-dev
# (AES-GCM of sealed blocks without the GIL, kvfs/format/_seal.c), a venv in
# ./.venv, torch (CPU build) for the client, and kvfs itself with its dev extras.
# Idempotent: a second run only checks. Run as root (or with sudo) for the apt step.
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(fuse3 libfuse3-dev pkg-config gcc python3-dev python3-venv attr libxxhash-dev libzstd-dev
      libssl-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch (CPU build)"
  .venv/bin/pip install -q torch==2.13.0
fi
echo "setup: installing kvfs"
.venv/bin/pip install -q -e '.[dev,client]'
.venv/bin/python -c "import kvfs.client._fastread" 2>/dev/null || echo "setup: warning: kvfs.client._fastread did not build (gcc, libxxhash-dev?): loads take the slower Python reads"
.venv/bin/python -c "import kvfs.format._codec" 2>/dev/null || echo "setup: warning: kvfs.format._codec did not build (gcc, libzstd-dev?): blocks go to the lower tiers as saved, not encoded"
.venv/bin/python -c "import kvfs.format._seal" 2>/dev/null || echo "setup: warning: kvfs.format._seal did not build (gcc, libssl-dev?): sealed blocks are opened on one core"
.venv/bin/python -c "import kvfs.daemon._passthrough" 2>/dev/null || echo "setup: warning: kvfs.daemon._passthrough did not build (gcc?): the daemon serves every byte of the mount itself"
.venv/bin/kvfs --version
