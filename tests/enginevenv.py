"""Run kvfs.integrations.drive in the engines' venv (.venv-engines, tools/setup_engines.sh).

In CI (CI=true) the venv must exist: its absence fails the test. Elsewhere the test skips and
says how to build it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv-engines" / "bin" / "python"


def engines_python() -> Path:
    if PYTHON.exists():
        return PYTHON
    why = f"no {PYTHON.relative_to(ROOT)}: run tools/setup_engines.sh"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why} (CI builds it in tools/test.sh)")
    pytest.skip(why)


def drive(engine: str, plans: list[dict[str, Any]], timeout: float = 600) -> list[dict]:
    """Run ``plans`` in one process of the engines' venv; one answer per plan."""
    res = subprocess.run([str(engines_python()), "-m", "kvfs.integrations.drive", engine,
                          json.dumps(plans)], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    lines = res.stdout.strip().splitlines()
    if res.returncode != 0 or not lines:
        raise AssertionError(f"drive {engine} failed ({res.returncode}):\n"
                             f"{res.stdout[-3000:]}\n{res.stderr[-6000:]}")
    out = json.loads(lines[-1])
    assert isinstance(out, list) and len(out) == len(plans), out
    return out


def block_file(root: Path, name: str) -> Path:
    """The one file of block ``name`` (32 hex) under ``root`` (a tenant, in the mount or the
    backing directory)."""
    found = list(root.glob(f"*/{name[:2]}/{name}.kv"))
    assert len(found) == 1, (name, found)
    return found[0]


def corrupt(path: Path, offset: int = 4096 + 100) -> None:
    """Flip one byte of a block file's payload in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
