"""Shared fixtures: a real kvfs mount run as a subprocess, as users run it.

Real-mount tests need root (or a setuid fusermount3) and /dev/fuse; without them they skip
with that reason. The daemon's log is checked after every test: a traceback fails the test
that caused it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

KVFS = [sys.executable, "-m", "kvfs.cli"]


def fuse_available() -> str | None:
    """None if real mounts can run here, else why not."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "fusermount3 not installed (apt install fuse3)"
    if os.getuid() != 0:
        return "real-mount tests run as root (they create tenants owned by other uids)"
    return None


def kvfs(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run([*KVFS, *args], capture_output=True, text=True, **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"kvfs {' '.join(args)} failed ({res.returncode}):\n"
                             f"{res.stdout}\n{res.stderr}")
    return res


@dataclass
class Mount:
    backing: Path
    mnt: Path
    log: Path
    extra: list[str] = field(default_factory=list)

    def start(self) -> None:
        kvfs("mount", str(self.backing), str(self.mnt), "--log", str(self.log), *self.extra)
        assert os.path.ismount(self.mnt)

    def stop(self) -> None:
        if os.path.ismount(self.mnt):
            kvfs("umount", str(self.mnt))

    def restart(self) -> None:
        self.stop()
        self.start()

    def pid(self) -> int:
        import json

        return json.loads((self.mnt / ".kvfs" / "stats.json").read_bytes())["pid"]

    def stats(self) -> dict:
        import json

        return json.loads((self.mnt / ".kvfs" / "stats.json").read_bytes())

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


def abort_connection(mnt: Path) -> None:
    """Abort the FUSE connection of `mnt` (fusectl), failing every request still waiting on
    it. A daemon killed with SIGKILL can be left unable to exit: a thread of it inside a kernel
    notification waits on a directory lock that a request it will never answer holds; the
    connection then lives on, and processes using the mount hang, until it is aborted."""
    dev = None
    with open("/proc/self/mountinfo") as f:  # (a stat of the mount point would hang too)
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[4] == str(mnt):
                dev = fields[2]
    if dev is None:
        return
    conns = "/sys/fs/fuse/connections"
    if not os.listdir(conns):
        subprocess.run(["mount", "-t", "fusectl", "none", conns], capture_output=True)
    try:
        with open(f"{conns}/{dev.split(':')[1]}/abort", "w") as f:
            f.write("1")
    except OSError:
        pass


def force_unmount(mnt: Path) -> None:
    abort_connection(mnt)
    if os.path.ismount(mnt):
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
    if os.path.ismount(mnt):
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)


@pytest.fixture
def mount_factory() -> Iterator:
    why = fuse_available()
    if why:
        pytest.skip(why)
    mounts: list[Mount] = []
    # Other tenants' uids must be able to reach the mount point: a world-traversable base.
    tmp_path = Path(tempfile.mkdtemp(prefix="kvfs-test-"))
    os.chmod(tmp_path, 0o755)

    def make(name: str = "m", extra: list[str] | None = None, start: bool = True) -> Mount:
        base = tmp_path / name
        backing, mnt = base / "backing", base / "mnt"
        backing.mkdir(parents=True, exist_ok=True)
        mnt.mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o755)
        m = Mount(backing, mnt, base / "daemon.log", extra or [])
        mounts.append(m)
        if start:
            m.start()
        return m

    yield make
    problems = []
    for m in mounts:
        try:
            m.stop()
        except AssertionError as exc:
            problems.append(str(exc))
            force_unmount(m.mnt)
        text = m.log_text()
        if "Traceback" in text:
            problems.append(f"daemon log of {m.mnt} has a traceback:\n{text[-4000:]}")
    deadline = time.monotonic() + 5
    while any(os.path.ismount(m.mnt) for m in mounts) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not any(os.path.ismount(m.mnt) for m in mounts):
        shutil.rmtree(tmp_path, ignore_errors=True)
    if problems:
        pytest.fail("\n".join(problems))


@pytest.fixture
def mount(mount_factory) -> Mount:
    """One started mount over an empty backing directory."""
    return mount_factory()


def run_as(uid: int, gid: int, argv: list[str], **kw) -> subprocess.CompletedProcess:
    """Run a command as another uid/gid (a real process of another tenant)."""

    def drop() -> None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)

    return subprocess.run(argv, capture_output=True, text=True, preexec_fn=drop, **kw)


def in_child(uid: int, gid: int, fn, groups: tuple[int, ...] = ()):
    """Call `fn()` in a forked child running as uid:gid (with these supplementary groups),
    as a real process of another user would; returns what it returned (JSON-able), or
    raises the OSError it raised (as an OSError with the same errno)."""
    import json

    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        try:
            os.setgroups(list(groups))
            os.setgid(gid)
            os.setuid(uid)
            out = {"value": fn()}
        except OSError as exc:
            out = {"errno": exc.errno, "error": str(exc)}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = {"failed": repr(exc)}
        os.write(wfd, json.dumps(out).encode())
        os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        out = json.loads(f.read() or b'{"failed": "no answer"}')
    os.waitpid(pid, 0)
    if "errno" in out:
        raise OSError(out["errno"], out["error"])
    if "failed" in out:
        raise AssertionError(f"child failed: {out['failed']}")
    return out["value"]
