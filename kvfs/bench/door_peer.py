"""The peer of `kvfs bench door`: libfuse's own passthrough file system, in C.

What separates a FUSE mount from a plain directory is partly the FUSE channel (the kernel's
requests, their round trips, the copies) and partly the daemon's own work. To tell the two
apart on the machine measured, `kvfs bench door` replays the same patterns, in the same
repeats, through a FUSE daemon that does nothing but pass requests on, written in C by
libfuse's authors: `passthrough_ll`, the low-level passthrough example libfuse ships with
its development package (Debian's `libfuse3-dev`: /usr/share/doc/libfuse3-dev/examples),
compiled here with the system's C compiler against the system's libfuse. It is multithreaded
C that answers each request with the matching system call on the backing directory and keeps
nothing of its own: no index, no accounting, no checks. It is mounted with `cache=always`
(entry and attribute timeouts of a day and the page cache kept across opens, as kvfs keeps
it), without the write-back cache (off in kvfs by default). A figure the peer misses too is
out of reach for a FUSE daemon on this machine, whatever its language; the distance from the
peer to kvfs is kvfs's own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Any

from .harness import cpu_seconds

EXAMPLES = "/usr/share/doc/libfuse3-dev/examples"
SOURCE = "passthrough_ll.c"
NAME = "libfuse passthrough_ll (C)"
OPTIONS = "cache=always"


def missing() -> str | None:
    """Why the peer cannot be built here, or None."""
    if not os.path.exists(os.path.join(EXAMPLES, SOURCE)):
        return f"{EXAMPLES}/{SOURCE} is absent (Debian's libfuse3-dev ships it)"
    for tool in ("cc", "pkg-config", "fusermount3"):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH"
    return None


def build(where: str) -> str:
    """Compile the example into `where`; the binary's path. RuntimeError saying why not."""
    why = missing()
    if why:
        raise RuntimeError(f"the FUSE peer cannot be built: {why}")
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True,
                           text=True, check=False)
    if flags.returncode:
        raise RuntimeError(f"pkg-config fuse3: {flags.stderr.strip()}")
    out = os.path.join(where, "passthrough_ll")
    cc = subprocess.run(["cc", "-O2", "-o", out, os.path.join(EXAMPLES, SOURCE),
                         *flags.stdout.split()], capture_output=True, text=True, check=False)
    if cc.returncode:
        raise RuntimeError(f"compiling {SOURCE} failed: {cc.stderr.strip()[-2000:]}")
    return out


class PeerSide:
    """The peer mounted over `base/peer-backing` at `base/peer-mnt`; the interface of the
    door's kvfs side that the patterns use (root, pid, counters, since, stop)."""

    def __init__(self, base: str, binary: str, options: str = OPTIONS) -> None:
        self.backing = os.path.join(base, "peer-backing")
        self.mnt = os.path.join(base, "peer-mnt")
        self.binary = binary
        self.options = options
        self.root = ""
        self.pid = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> None:
        os.makedirs(self.backing)
        os.makedirs(self.mnt)
        self.proc = subprocess.Popen(
            [self.binary, "-f", "-o", f"source={self.backing},{self.options}", self.mnt],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.pid = self.proc.pid
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mnt):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = b""
                if self.proc.poll() is None:
                    self.proc.kill()
                    self.proc.wait()
                if self.proc.stderr is not None:
                    err = self.proc.stderr.read()
                raise RuntimeError(f"{NAME} did not mount {self.mnt} (--no-peer skips the "
                                   f"peer): {err.decode(errors='replace').strip()}")
            time.sleep(0.02)
        self.root = os.path.join(self.mnt, "bench")
        os.mkdir(self.root)

    def counters(self) -> dict[str, Any]:
        """CPU seconds of the peer's process (it counts no requests of its own)."""
        return {"requests": {}, "bytes": 0, "cpu_s": cpu_seconds(self.pid)}

    def since(self, before: dict[str, Any]) -> dict[str, Any]:
        return {"requests": {}, "bytes": 0,
                "cpu_s": self.counters()["cpu_s"] - before["cpu_s"]}

    def stop(self) -> None:
        if self.proc is None:
            return
        subprocess.run(["fusermount3", "-u", "-z", self.mnt], capture_output=True, check=False)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None
