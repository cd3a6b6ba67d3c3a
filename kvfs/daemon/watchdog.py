"""The mount's watchdog: a small process that ends a mount whose daemon died without
unmounting it (SIGKILL, the OOM killer, a crash in native code).

Why it is needed: a daemon killed with SIGKILL can be left unable to exit. pyfuse3 sends the
kernel its notifications (eviction's `invalidate_entry`) from a thread of its own; the kernel
handles one by taking the directory's lock, and a request of another process (a lookup in
that directory) may hold that lock while it waits for the daemon's answer. The dead daemon
never answers, the notifying thread waits in the kernel where no signal reaches it, so the
process never ends, its `/dev/fuse` descriptor never closes, the connection is never
aborted, and every process that touches the mount hangs.

The daemon starts the watchdog right after mounting (`start`), as a child of its main thread,
and hands it a pipe. The watchdog asks the kernel for a signal when that thread ends
(`PR_SET_PDEATHSIG`). A daemon that stops cleanly writes `CLEAN` to the pipe first (after it
has closed its session); otherwise the watchdog aborts the connection through the fuse
control filesystem (every request waiting on it fails, the stuck thread gets its lock, the
daemon's process ends) and, once the daemon is gone, detaches the dead mount so that the
mount point can be mounted again (the next mount reconciles the index as after any crash).

The watchdog knows its mount by more than what /proc/self/mountinfo shows: the kernel gives a
mount made right after another is gone the same mount id and the same device number (both
are the lowest free), so a watchdog that looked after its daemon had died only by those could
take a new mount at the same mount point for its own, and abort and detach it. It also keeps
the inode number of the mount's FUSE connection in the fuse control filesystem, which a new
connection does not reuse, and leaves alone a mount whose connection is not that one.

Run as `python -m kvfs.daemon.watchdog DAEMON_PID MOUNTPOINT
MOUNT_ID:MAJOR:MINOR[:CONNECTION_INODE]` with the pipe on stdin.
Standard library only: it must start fast and never depend on the daemon's state.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import signal
import subprocess
import sys
import time

CLEAN = b"clean\n"
CONNECTIONS = "/sys/fs/fuse/connections"
_PR_SET_PDEATHSIG = 1
_MNT_DETACH = 2
#: How long the watchdog waits for the daemon's process to end once its connection is aborted.
EXIT_WAIT = 30.0


def start(mountpoint: str) -> int | None:
    """Start the watchdog of the mount at `mountpoint` (made by this process); returns the
    pipe's write end, to be passed to `clean_stop` when the daemon stops cleanly, or None
    when the mount cannot be found (then there is nothing to watch)."""
    dev = mount_device(mountpoint)
    if dev is None:
        return None
    ino = connection_inode(dev)
    if ino is not None:
        dev = f"{dev}:{ino}"
    rfd, wfd = os.pipe2(os.O_CLOEXEC)
    env = dict(os.environ)  # this very kvfs, wherever the daemon's working directory is
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    try:
        subprocess.Popen([sys.executable, "-m", "kvfs.daemon.watchdog", str(os.getpid()),
                          mountpoint, dev], stdin=rfd, close_fds=True, env=env)
    finally:
        os.close(rfd)
    return wfd


def clean_stop(wfd: int | None) -> None:
    """The daemon has closed its session: tell the watchdog to leave the mount alone."""
    if wfd is not None:
        try:
            os.write(wfd, CLEAN)
        except OSError:
            pass  # the watchdog is gone: nothing to tell
        os.close(wfd)


def _unescape(field: str) -> str:
    r"""A path as /proc/self/mountinfo writes it: space, tab, newline and backslash as
    ``\ooo`` octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_fields(mountpoint: str) -> list[str] | None:
    """The /proc/self/mountinfo fields of the newest mount at `mountpoint` (not a stat of the
    mount point: that would be a request to a daemon that may be dead, or this very one)."""
    found = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and _unescape(fields[4]) == mountpoint:
                    found = fields  # the last match is the newest mount
    except OSError:
        return None
    return found


def mount_device(mountpoint: str) -> str | None:
    """MOUNT_ID:MAJOR:MINOR of the newest mount at `mountpoint`."""
    fields = mount_fields(mountpoint)
    return None if fields is None else f"{fields[0]}:{fields[2]}"


def connections_mounted() -> bool:
    """Whether the fuse control filesystem is there (mounted here if not, as root)."""
    try:
        if os.listdir(CONNECTIONS):
            return True
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount(b"fusectl", CONNECTIONS.encode(), b"fusectl", 0, None)
        return bool(os.listdir(CONNECTIONS))
    except OSError:
        return False


def connection_inode(dev: str) -> int | None:
    """The inode number of the FUSE connection of mount `dev` (MOUNT_ID:MAJOR:MINOR) in the
    fuse control filesystem, or None where it cannot be seen."""
    if not connections_mounted():
        return None
    try:
        return os.stat(f"{CONNECTIONS}/{dev.split(':')[2]}").st_ino
    except OSError:
        return None


def same_mount(mountpoint: str, dev: str) -> bool:
    """Whether the newest mount at `mountpoint` is the one `start` saw (`dev`: its mount id,
    device number and, where known, the inode of its connection)."""
    parts = dev.split(":")
    if mount_device(mountpoint) != ":".join(parts[:3]):
        return False
    return len(parts) < 4 or str(connection_inode(dev)) == parts[3]


def _running(stat_path: str) -> bool:
    """Whether the thread whose /proc stat file this is runs (not a zombie, not dead)."""
    try:
        with open(stat_path, "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _thread_alive(tid: int) -> bool:
    """Whether thread `tid` (a process's main thread: its pid) is running, not a zombie."""
    return _running(f"/proc/{tid}/stat")


def alive(pid: int) -> bool:
    """Whether any thread of process `pid` is still running (not a zombie)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any(_running(f"/proc/{pid}/task/{tid}/stat") for tid in tids)


def _say(text: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"{stamp} {os.getpid()} WARNING kvfs.daemon.watchdog: {text}", file=sys.stderr,
          flush=True)


def _abort(dev: str) -> bool:
    connections_mounted()
    try:
        with open(f"{CONNECTIONS}/{dev.split(':')[2]}/abort", "w") as f:
            f.write("1")
    except OSError as exc:
        _say(f"cannot abort the connection {dev}: {exc}")
        return False
    return True


def abort_connection(mountpoint: str) -> bool:
    """Abort the FUSE connection of the mount at `mountpoint` (fusectl, as root), failing
    every request waiting on it: what frees a mount whose daemon is dead, stopped or hung.
    Whether it was aborted (False: not mounted, or not allowed)."""
    dev = mount_device(mountpoint)
    return dev is not None and _abort(dev)


def _detach(mountpoint: str) -> None:
    if os.getuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.umount2(mountpoint.encode(), _MNT_DETACH) == 0:
            return
        _say(f"cannot detach {mountpoint}: {os.strerror(ctypes.get_errno())}")
    else:
        subprocess.run(["fusermount3", "-uz", mountpoint], capture_output=True)


def watch(daemon: int, mountpoint: str, dev: str) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C at a foreground daemon is the daemon's
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGUSR1), 0, 0, 0)
    # The signal comes when the daemon's main thread ends; looking once a second too covers
    # an end before the request above (and a kernel that would not send it).
    while signal.sigtimedwait({signal.SIGUSR1}, 1.0) is None and _thread_alive(daemon):
        pass
    ready, _, _ = select.select([0], [], [], 0)
    if ready and os.read(0, len(CLEAN)) == CLEAN:
        return 0  # a clean stop: the daemon has closed its session itself
    if not same_mount(mountpoint, dev):
        return 0  # unmounted already (and maybe mounted again: not this watchdog's mount)
    _say(f"the daemon (pid {daemon}) of {mountpoint} ended without unmounting: aborting its "
         "connection and detaching the mount")
    _abort(dev)
    deadline = time.monotonic() + EXIT_WAIT
    while alive(daemon) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(daemon):
        _say(f"the daemon (pid {daemon}) is still there; leaving {mountpoint} mounted")
        return 1
    if same_mount(mountpoint, dev):
        _detach(mountpoint)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print("usage: python -m kvfs.daemon.watchdog DAEMON_PID MOUNTPOINT "
              "MOUNT_ID:MAJOR:MINOR[:CONNECTION_INODE]",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(watch(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
