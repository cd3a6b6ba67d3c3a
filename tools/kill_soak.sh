#!/usr/bin/env bash
# Soak the SIGKILL-under-load test (tests/test_kill.py): ROUNDS rounds (100 by default) of
# writers in place and by rename, readers, renames, unlinks, `ls -lR` and kvfs client saves
# and loads, the daemon killed with SIGKILL, then a remount that must find no complete file
# lost, none of a wrong size or content, every block sound, and a clean `kvfs fsck --verify`.
# Needs root and /dev/fuse, like the suite. Usage: sudo ./tools/kill_soak.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
KVFS_KILL_ROUNDS="${1:-100}" exec "$PY" -m pytest -q -x tests/test_kill.py -k under_load
