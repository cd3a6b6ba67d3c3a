"""The folders of kvfs are its layers, and imports run one way between them: each folder
imports only the folders below it (its ``__init__`` docstring says which). Read from the
source, lazy imports inside functions included, so that a new arrow back up fails here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "kvfs"

#: folder -> the folders it may import (besides itself). Top-level modules of kvfs: none
#: but ``kvfs/__init__.py``, the package's lazy front (``kvfs.KVCache``, ``kvfs.ModelSpec``).
ALLOWED = {
    "format": set(),
    "client": {"format"},
    "models": {"format", "client"},
    "daemon": {"format", "models"},
    "integrations": {"format", "client"},
    "bench": {"format", "client", "models", "daemon", "integrations"},
    "cli": {"format", "client", "models", "daemon", "integrations", "bench"},
}
#: What of the models the daemon runs: the eviction policies (the simulator drives the same).
DAEMON_MODELS = {"kvfs.models.policy"}


def folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else None


def imports(path: Path) -> set[str]:
    """The kvfs modules (or packages) ``path`` imports, relative imports resolved."""
    rel = path.relative_to(ROOT.parent).with_suffix("")
    pkg = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "kvfs"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "kvfs":
                continue
            for a in node.names:  # `from kvfs.format import blockfile`: the module itself
                sub = f"{mod}.{a.name}"
                out.add(sub if (ROOT.parent / (sub.replace(".", "/") + ".py")).exists()
                        or (ROOT.parent / sub.replace(".", "/")).is_dir() else mod)
    return out


def test_every_module_lives_in_a_folder():
    loose = [p.name for p in ROOT.glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules outside the layers' folders: {loose}"
    for name in ALLOWED:
        doc = ast.get_docstring(ast.parse((ROOT / name / "__init__.py").read_text()))
        assert doc and "\nImports: " in doc, f"kvfs/{name}/__init__.py: what may it import?"


def test_imports_run_one_way():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.parent == ROOT:
            continue
        here = path.relative_to(ROOT).parts[0]
        for mod in imports(path):
            there = folder(mod)
            if there is None or there == here:
                continue
            if there not in ALLOWED[here]:
                wrong.append(f"{path.relative_to(ROOT.parent)} imports {mod}")
            elif here == "daemon" and there == "models" and mod not in DAEMON_MODELS:
                wrong.append(f"{path.relative_to(ROOT.parent)} imports {mod} (the daemon "
                             f"runs only {sorted(DAEMON_MODELS)} of the models)")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_an_arrow_back_up(tmp_path):
    """The reader of imports resolves relative and lazy imports (the test above cannot pass
    by reading nothing)."""
    probe = ROOT / "format" / "codec.py"
    got = imports(probe)
    assert "kvfs.format.blockfile" in got
    daemon = imports(ROOT / "daemon" / "fs.py")
    assert "kvfs.format.hashing" in daemon and "kvfs.daemon.tree" in daemon
    assert folder("kvfs.daemon.fs") == "daemon" and folder("kvfs") is None
