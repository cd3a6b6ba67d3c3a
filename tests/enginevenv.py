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


def check_raw_floor(engine: str, directory: Path, unit_bytes: int,
                    plan: dict[str, Any]) -> None:
    """Run the benchmark's physical floor (``backend: raw``, 2 repeats) on ``plan``'s pages
    or chunks of ``unit_bytes`` into ``directory`` and check that it moved every byte: each
    set wrote each page or chunk, as the engine holds it, to a file of its own (a floor that
    timed anything less would flatter every backend beside it)."""
    import hashlib

    from kvfs.integrations.drive import _seeded, _sha

    n = plan["count"]
    r = drive(engine, [plan | {"backend": "raw", "dir": str(directory), "seed": "r",
                               "repeats": 2, "ops": ["bench"]}])[0]
    assert "error" not in r, r
    assert r["bench"]["bytes"] == n * unit_bytes
    assert r["bench"]["set_s"] > 0 and r["bench"]["get_warm_s"] > 0
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        f"{rep}-{i}" for rep in range(2) for i in range(n))
    for i in range(n):
        want = _sha(_seeded(f"r/{i}", unit_bytes))
        for rep in range(2):
            assert hashlib.sha256((directory / f"{rep}-{i}").read_bytes()).hexdigest() == want


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
