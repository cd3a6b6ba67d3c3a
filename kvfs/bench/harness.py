"""The one harness of every benchmark and of the tests' mount fixtures.

- :class:`Mount`: a kvfs mount over a backing directory, started as a user starts it
  (``kvfs mount``, ``kvfs tenant add``) and unmounted reliably (``kvfs umount``; a daemon
  that does not answer: its FUSE connection aborted, then ``fusermount3 -u``/``-uz``);
- the S3 server (:class:`S3Server`, SeaweedFS on loopback, from :mod:`kvfs.bench.seaweed`)
  and :class:`FaultProxy`, a loopback TCP proxy that makes a store slow, silent or absent;
- the page cache: :func:`drop_caches`, :func:`settle` (wait for the daemon to handle the
  FORGETs a drop sends it);
- one conditions schema (:func:`conditions`, :func:`conditions_after`, from
  :mod:`kvfs.bench.machine`): what every record says about the machine it was measured on;
- statistics: :func:`median`, :func:`quantile`, :func:`summary`.

Stdlib only at import: `kvfs bench --help` and the tests import it without torch.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..daemon import watchdog
from .machine import (  # noqa: F401 - the conditions schema, re-exported for every benchmark
    CONDITION_KEYS,
    DROP_CACHES,
    VERSIONS,
    busy_cpus,
    can_drop_caches,
    conditions,
    conditions_after,
    cpu_model,
    filesystem_of,
    first_line,
    kvfs_checkout,
    memory_gib,
    page_reclaim,
    read_text,
)
from .seaweed import CLIENT_ENV, REGION, S3Server, free_ports, weed_binary

__all__ = ["CLIENT_ENV", "REGION", "S3Server", "free_ports", "weed_binary"]

#: How the daemon and the CLI are started: this interpreter, so this checkout's kvfs.
KVFS = [sys.executable, "-m", "kvfs.cli"]
#: The KV shape of Llama-3-8B (layers, KV heads, head_dim; bfloat16): the restore, tiers and
#: codec benchmarks' synthetic blocks.
LLAMA_LAYERS, LLAMA_KV_HEADS, LLAMA_HEAD_DIM = 32, 8, 128
LLAMA_TOKEN_BYTES = LLAMA_LAYERS * 2 * LLAMA_KV_HEADS * LLAMA_HEAD_DIM * 2


def log(msg: str, *, err: bool = False) -> None:
    """A benchmark's progress line, timestamped, on stdout (``err``: stderr)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr if err else sys.stdout,
          flush=True)


def llama_spec(block_mib: float) -> Any:
    """The model spec of Llama-3-8B-shaped blocks of ``block_mib`` MiB (at least a token)."""
    from ..format.hashing import ModelSpec  # noqa: PLC0415

    return ModelSpec(model="bench/llama-3-8b-shape", revision="r1", kv_dtype="bfloat16",
                     block_size=max(1, int(block_mib * (1 << 20)) // LLAMA_TOKEN_BYTES),
                     num_layers=LLAMA_LAYERS, num_kv_heads=LLAMA_KV_HEADS,
                     head_dim=LLAMA_HEAD_DIM)


# -- statistics ----------------------------------------------------------------------------------


def host_buffer(nbytes: int) -> memoryview:
    """Page-aligned anonymous memory for a baseline to read into, aligned as the client's
    destinations are (torch's host allocations start on a 64-byte line). A bytearray's
    data starts 16 bytes past one, and the kernel's copy into memory so placed ran at a
    third of its speed on these machines (2.3-3.5 against 7.6-11 GB/s from the page cache,
    the same files, 8 threads): a baseline read there would flatter kvfs."""
    return memoryview(mmap.mmap(-1, max(1, nbytes)))[:nbytes]


def median(xs: Sequence[float]) -> float | None:
    """The median (the mean of the two middle values of an even count); None of nothing."""
    s = sorted(xs)
    n = len(s)
    if not n:
        return None
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def quantile(xs: Sequence[float], q: float) -> float | None:
    """The nearest-rank quantile ``q`` in [0, 1] (p99 of 50 samples is their maximum)."""
    s = sorted(xs)
    if not s:
        return None
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summary(xs: Sequence[float]) -> dict[str, Any]:
    """Count, p50, p99, max and min of ``xs``."""
    return {"n": len(xs), "p50": median(xs), "p99": quantile(xs, 0.99),
            "max": max(xs) if xs else None, "min": min(xs) if xs else None}


# -- mounts ------------------------------------------------------------------------------------


class KvfsError(RuntimeError):
    """A `kvfs` command failed; the message has its output."""


def fuse_available() -> str | None:
    """None if real mounts can run here, else why not."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "fusermount3 not installed (apt install fuse3)"
    if os.getuid() != 0:
        return "real mounts run as root (they create tenants owned by other uids)"
    return None


def run_kvfs(*args: str, check: bool = True, prefix: Sequence[str] = (),
             **kw: Any) -> subprocess.CompletedProcess:
    """``kvfs ARGS`` as a subprocess of this interpreter (behind ``prefix``, a command such
    as ``nsenter --net=...``); KvfsError when it fails (check)."""
    res = subprocess.run([*prefix, *KVFS, *map(str, args)], capture_output=True, text=True,
                         **kw)
    if check and res.returncode != 0:
        raise KvfsError(f"kvfs {' '.join(map(str, args))} failed ({res.returncode}):\n"
                        f"{res.stdout}\n{res.stderr}")
    return res


def mounted(mnt: str | Path) -> bool:
    """Whether `mnt` is in this process's mount table (a dead daemon's mount, which
    os.path.ismount cannot stat, included)."""
    return any(len(f) > 4 and f[4] == str(mnt) for f in
               (line.split() for line in read_text("/proc/self/mountinfo").splitlines()))


def abort_connection(mnt: str | Path) -> None:
    """Abort the FUSE connection of `mnt` (fusectl), failing every request still waiting on
    it. A daemon killed with SIGKILL can be left unable to exit: a thread of it inside a kernel
    notification waits on a directory lock that a request it will never answer holds; the
    connection then lives on, and processes using the mount hang, until it is aborted."""
    watchdog.abort_connection(str(mnt))


def force_unmount(mnt: str | Path) -> None:
    """Unmount `mnt` whatever its daemon does: abort its connection, then unmount, lazily
    if need be."""
    abort_connection(mnt)
    for flags in ("-u", "-uz"):
        if mounted(mnt):
            subprocess.run(["fusermount3", flags, str(mnt)], capture_output=True)


@dataclass
class Mount:
    """A kvfs mount over ``backing`` at ``mnt``, its daemon logging to ``log``."""

    backing: Path
    mnt: Path
    log: Path
    extra: list[str] = field(default_factory=list)
    #: The daemon's environment (None: this one's), e.g. an S3 identity.
    env: dict[str, str] | None = None
    name: str = ""
    #: The key-encryption key (``--key-file``) unless ``extra`` names one (None: the default).
    key_file: str | None = None
    #: A command the daemon is started behind, e.g. ``nsenter --net=/run/netns/NAME`` for a
    #: host of its own on the network.
    prefix: list[str] = field(default_factory=list)

    @classmethod
    def under(cls, base: str | Path, extra: Sequence[str] = (), **kw: Any) -> Mount:
        """A mount of ``base/backing`` at ``base/mnt`` logging to ``base/daemon.log``; the
        directories made, ``base`` traversable by every uid (tenants' processes)."""
        base = Path(base)
        (base / "backing").mkdir(parents=True, exist_ok=True)
        (base / "mnt").mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o755)
        kw.setdefault("name", base.name)
        return cls(base / "backing", base / "mnt", base / "daemon.log", list(extra), **kw)

    def start(self, timeout: float | None = None) -> float:
        """Mount (``kvfs mount`` returns once the daemon serves); the seconds it took."""
        t = time.perf_counter()
        keys = ([] if self.key_file is None
                or any(a in ("--key-file", "--key-command") for a in self.extra)
                else ["--key-file", self.key_file])
        run_kvfs("mount", self.backing, self.mnt, "--log", self.log, *self.extra, *keys,
                 env=self.env, timeout=timeout, prefix=self.prefix)
        dt = time.perf_counter() - t
        if not os.path.ismount(self.mnt):
            raise KvfsError(f"kvfs mount returned but {self.mnt} is not a mount point")
        return dt

    def add_tenant(self, tenant: str, uid: int | None = None, gid: int | None = None) -> Path:
        """``kvfs tenant add`` (this process's uid/gid by default); the tenant's directory."""
        run_kvfs("tenant", "add", self.mnt, tenant, "--uid",
                 str(os.getuid() if uid is None else uid), "--gid",
                 str(os.getgid() if gid is None else gid))
        return Path(self.mnt) / tenant

    def stop(self, *, check: bool = True, timeout: float | None = None) -> float:
        """``kvfs umount``; the seconds it took. A failed unmount raises KvfsError (check)
        after unmounting by force, or just unmounts by force (not check)."""
        t = time.perf_counter()
        if os.path.ismount(self.mnt):
            args = ["umount", self.mnt, *([] if timeout is None else ["--timeout",
                                                                         str(int(timeout))])]
            res = run_kvfs(*args, check=False)
            if res.returncode != 0:
                force_unmount(self.mnt)
                if check:
                    raise KvfsError(f"kvfs umount {self.mnt} failed ({res.returncode}):\n"
                                    f"{res.stdout}\n{res.stderr}")
        elif mounted(self.mnt):  # a dead daemon leaves a mount the kernel must drop
            force_unmount(self.mnt)
        return time.perf_counter() - t

    def restart(self) -> None:
        self.stop()
        self.start()

    def stats(self) -> dict[str, Any]:
        """The daemon's ``.kvfs/stats.json``."""
        with open(os.path.join(self.mnt, ".kvfs", "stats.json"), "rb") as f:
            return json.loads(f.read())

    def pid(self) -> int:
        return int(self.stats()["pid"])

    def wait_uploaded(self, n: int, timeout: float = 300.0) -> int:
        """Wait until the mount's last tier (the shared one) counts ``n`` uploads, or
        ``timeout`` seconds: the count reached."""
        deadline = time.monotonic() + timeout
        while True:
            tiers = self.stats().get("tiers") or [{}]
            done = tiers[-1].get("uploads", 0)
            if done >= n or time.monotonic() > deadline:
                return done
            time.sleep(0.2)

    def tier(self, i: int = 0) -> dict[str, Any]:
        """The counters of the mount's `i`-th lower tier."""
        return self.stats()["tiers"][i]

    @property
    def alive(self) -> bool:
        try:
            self.stats()
        except OSError:
            return False
        return True

    def memory(self) -> dict[str, float]:
        """The daemon's resident memory now and at its peak, MiB (VmRSS, VmHWM)."""
        out = {}
        for line in read_text(f"/proc/{self.pid()}/status").splitlines():
            key, _, val = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(val.split()[0]) / 1024
        return out

    def log_text(self) -> str:
        return read_text(self.log)

    def tracebacks(self) -> int:
        """How many tracebacks the daemon logged."""
        return self.log_text().count("Traceback")

    def log_excerpt(self, n: int = 30, grep: Sequence[str] = ("WARNING", "ERROR", "Traceback")
                    ) -> list[str]:
        """The last `n` lines of the daemon's log that hold one of `grep`."""
        return [line for line in self.log_text().splitlines()
                if any(g in line for g in grep)][-n:]


# -- the page cache ------------------------------------------------------------------------------


def cpu_ticks(pid: int) -> int:
    """User + system clock ticks a process has used."""
    fields = read_text(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
    return int(fields[11]) + int(fields[12]) if len(fields) > 12 else 0


def cpu_seconds(pid: int) -> float:
    """CPU seconds process `pid` has used (:func:`cpu_ticks` in seconds)."""
    return cpu_ticks(pid) / os.sysconf("SC_CLK_TCK")


def settle(pid: int, limit: float = 120.0, step: float = 0.2, idle_ticks: int = 1) -> float:
    """Wait until process `pid` (a daemon) is idle: at most `idle_ticks` ticks over `step`
    seconds (dropping the kernel's dentries sends a daemon one FORGET per inode, which it
    handles after drop_caches has returned); the seconds waited."""
    t = time.perf_counter()
    last = cpu_ticks(pid)
    while time.perf_counter() - t < limit:
        time.sleep(step)
        now = cpu_ticks(pid)
        if now - last <= idle_ticks:
            break
        last = now
    return time.perf_counter() - t


def drop_caches(level: int = 3, daemon_pid: int | None = None) -> bool:
    """``sync; echo LEVEL > drop_caches`` (1: page cache; 2: dentries and inodes; 3: both),
    then, given a daemon, wait until it has handled the FORGETs; False when not allowed."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write(str(level))
    except OSError:
        return False
    if daemon_pid is not None:
        settle(daemon_pid, limit=30, step=0.1, idle_ticks=0)
    return True


# -- a slow, silent or absent store ----------------------------------------------------------------


class FaultProxy:
    """A TCP proxy to ``target`` (host, port) listening on ``host`` (loopback by default), a
    thread pair per connection.

    ``mode`` "forward" passes bytes on: ``delay`` seconds are added before each chunk a client
    sends is passed on (one request of an HTTP client that waits for its answer is one
    chunk); each response's first byte (the first server bytes after the client sent some)
    is held ``latency`` seconds; the server's bytes are paced to ``bandwidth`` bytes/s per
    connection (0: unpaced). Mode "silent" accepts connections and reads requests but never
    passes them on nor answers (a store that hangs); it may be set at any time and holds
    for connections already open. A connection the target refuses is closed at once
    (counted in ``refused``). Close the proxy to drop every connection.
    """

    def __init__(self, target: tuple[str, int] | None = None, *, mode: str = "forward",
                 delay: float = 0.0, latency: float = 0.0, bandwidth: float = 0.0,
                 host: str = "127.0.0.1") -> None:
        if mode not in ("forward", "silent") or (mode == "forward" and target is None):
            raise ValueError(f"bad proxy mode {mode!r} / target {target!r}")
        self.target, self.mode = target, mode
        self.delay, self.latency, self.bandwidth = delay, latency, bandwidth
        self.connections = self.requests = self.swallowed = self.refused = 0
        self.host = host  # the address it listens on
        self._listener = socket.create_server((host, 0), backlog=256)
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _keep(self, s: socket.socket) -> bool:
        with self._lock:
            if self._closed:
                s.close()
                return False
            self._socks.append(s)
            return True

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not self._keep(conn):
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _swallow(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while conn.recv(1 << 16):
                self.swallowed += 1

    def _serve(self, conn: socket.socket) -> None:
        if self.mode == "silent" or self.target is None:
            self._swallow(conn)
            return
        try:
            up = socket.create_connection(self.target, timeout=10)
        except OSError:
            self.refused += 1
            conn.close()
            return
        up.settimeout(None)
        if not self._keep(up):
            conn.close()
            return
        asked = threading.Event()

        def client_to_server() -> None:
            with contextlib.suppress(OSError):
                while data := conn.recv(1 << 16):
                    if self.mode == "silent":
                        self.swallowed += 1
                        continue
                    if self.delay > 0:
                        time.sleep(self.delay)
                    self.requests += 1
                    asked.set()
                    up.sendall(data)
            with contextlib.suppress(OSError):
                up.shutdown(socket.SHUT_WR)

        threading.Thread(target=client_to_server, daemon=True).start()
        with contextlib.suppress(OSError):
            while data := up.recv(1 << 16):
                if asked.is_set():
                    asked.clear()
                    if self.latency > 0:
                        time.sleep(self.latency)
                if self.bandwidth:
                    time.sleep(len(data) / self.bandwidth)
                conn.sendall(data)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._socks = self._socks, []
        self._listener.close()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def refused_port() -> int:
    """A loopback port nobody listens on (connections to it are refused)."""
    (port,) = free_ports(1)
    return port
