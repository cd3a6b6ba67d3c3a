"""SIGKILL under load: the daemon killed while ordinary tools and the kvfs client work.

Each round runs writers in place and by rename, readers, renames and unlinks (their every
completed step journaled outside the mount), `ls -lR` in a loop, and kvfs client saves and
loads; then the daemon is killed with SIGKILL. Nothing from outside helps it go (no
fusectl, no fusermount): its process must end and its mount must go by themselves (the
watchdog, `kvfs.daemon.watchdog`), and no process on the mount may hang. At the next mount: no
complete file is lost, none has a wrong size or content, every block loads and verifies, and
a full `kvfs fsck --verify` of the tree finds nothing to fix.

`KVFS_KILL_ROUNDS` sets the number of rounds (10 by default); `tools/kill_soak.sh` runs 100.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .conftest import force_unmount, kvfs

torch = pytest.importorskip("torch")

import kvfs as kv  # noqa: E402
from kvfs.daemon import watchdog  # noqa: E402
from kvfs.format import hashing  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
from . import kvload  # noqa: E402

SPEC = kvload.spec("kill/test")

#: Files of the POSIX workload: "KVT1 <id> <size>\n" and then bytes derived from the id, so
#: that any file can be checked on its own; the journal says which id each name must hold.
FILES = textwrap.dedent("""
    import os, random, sys, threading
    root, journal, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    jfd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    locks = {}

    def note(line):
        os.write(jfd, (line + "\\n").encode())

    def content(ident, size):
        head = f"KVT1 {ident} {size}\\n".encode()
        return head + random.Random(ident).randbytes(max(0, size - len(head)))

    def check(path):
        with open(path, "rb") as f:
            data = f.read()
        head, _, _ = data.partition(b"\\n")
        _, ident, size = head.decode().split()
        if content(ident, int(size)) != data:
            print("WRONG", path, flush=True)
            os._exit(3)

    def writer(k):
        rng = random.Random(seed * 100 + k)
        names = [f"w{k}_{i}" for i in range(6)]
        for n in names:
            locks[n] = threading.Lock()
        step = 0
        while True:
            step += 1
            name = rng.choice(names)
            path = os.path.join(root, name)
            ident = f"{seed}.{k}.{step}"
            op = rng.random()
            with locks[name]:
                try:
                    if op < 0.35:
                        note(f"B {name}")
                        with open(path, "wb") as f:
                            f.write(content(ident, rng.randrange(1, 48000)))
                        note(f"E {name} {ident}")
                    elif op < 0.7:
                        note(f"B {name} {name}.tmp")
                        with open(path + ".tmp", "wb") as f:
                            f.write(content(ident, rng.randrange(1, 48000)))
                        os.replace(path + ".tmp", path)
                        note(f"E {name}.tmp -")
                        note(f"E {name} {ident}")
                    elif op < 0.85:
                        other = rng.choice(names)
                        if other == name or not os.path.exists(path):
                            continue
                        with locks[other]:
                            with open(path, "rb") as f:
                                held = f.readline().split()[1].decode()
                            note(f"B {name} {other}")
                            os.rename(path, os.path.join(root, other))
                            note(f"E {name} -")
                            note(f"E {other} {held}")
                    elif os.path.exists(path):
                        note(f"B {name}")
                        os.unlink(path)
                        note(f"E {name} -")
                except FileNotFoundError:
                    pass

    def reader(k):
        rng = random.Random(seed * 1000 + k)
        while True:
            name = f"w{rng.randrange(3)}_{rng.randrange(6)}"
            lock = locks.get(name)
            if lock is None:
                continue
            with lock:
                try:
                    check(os.path.join(root, name))
                except FileNotFoundError:
                    pass

    for k in range(3):
        threading.Thread(target=writer, args=(k,), daemon=True).start()
    for k in range(2):
        threading.Thread(target=reader, args=(k,), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()
""")

def content(ident: str, size: int) -> bytes:
    head = f"KVT1 {ident} {size}\n".encode()
    return head + random.Random(ident).randbytes(max(0, size - len(head)))


def held_id(path: Path) -> str:
    """The id a workload file holds, after checking its size and every byte."""
    data = path.read_bytes()
    head, _, _ = data.partition(b"\n")
    magic, ident, size = head.decode().split()
    assert magic == "KVT1" and content(ident, int(size)) == data, f"{path}: wrong content"
    return ident


def expected(journal: Path) -> tuple[dict[str, str], set[str]]:
    """From the journal: what each name must hold ("-": nothing), and the names a step was
    on when the daemon died (any state their step allows)."""
    state: dict[str, str] = {}
    busy: set[str] = set()
    for line in journal.read_text().splitlines():
        kind, *rest = line.split()
        if kind == "B":
            busy.update(rest)
        elif len(rest) == 2:
            state[rest[0]] = rest[1]
            busy.discard(rest[0])
    return state, busy


def threads_alive(pid: int) -> bool:
    """Whether any thread of process `pid` still runs (a zombie has ended)."""
    return watchdog.alive(pid)


def mounted(mnt: Path) -> bool:
    with open("/proc/self/mountinfo") as f:  # (a stat of a dead mount would fail or hang)
        return any(line.split()[4] == str(mnt) for line in f)


def wait(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def kill_round(m, tmp_path: Path, round_: int, rng: random.Random) -> None:
    files_dir = m.mnt / "fs"
    journal = tmp_path / f"journal.{round_}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    (tmp_path / "files.py").write_text(FILES)
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "files.py"), str(files_dir),
                               str(journal), str(round_)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env),
             subprocess.Popen([sys.executable, kvload.__file__, str(m.mnt), str(round_), "kv",
                               SPEC.model, "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        procs.append(subprocess.Popen(
            ["sh", "-c", f"while :; do ls -lR {m.mnt} >/dev/null 2>&1; done"]))
        time.sleep(rng.uniform(0.5, 2.0))
        pid = m.pid()
        os.kill(pid, signal.SIGKILL)
        assert wait(lambda: not threads_alive(pid), 60), "the daemon did not end after SIGKILL"
        assert wait(lambda: not mounted(m.mnt), 30), "the dead daemon's mount stayed"
    finally:
        for p in procs:
            p.kill()
    for p in procs:
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{p.args[:2]} hangs on the dead mount") from None
        assert "WRONG" not in (out or ""), out
    m.start()  # reconciles the index after the unclean stop
    state, busy = expected(journal)
    present = {p.name for p in files_dir.iterdir()}
    for name in present:
        held_id(files_dir / name)  # every file there: right size, right bytes
    for name, ident in state.items():
        if name in busy:
            continue
        if ident == "-":
            assert name not in present, f"{name} was removed but is back"
        else:
            assert name in present, f"complete file {name} ({ident}) lost"
            assert held_id(files_dir / name) == ident, f"{name} holds an older version"
    hashes = kvload.all_blocks(m.backing / "kv" / SPEC.namespace)
    with kv.KVCache.open(m.mnt, tenant="kv", spec=SPEC) as cache:
        for h in hashes:
            out = torch.zeros(1, *SPEC.block_shape, dtype=torch.float16)
            if cache.load([h], out) == 1:
                assert torch.equal(out, kvload.content(SPEC, [h]))
            else:  # only a block evicted meanwhile (above the high watermark) may miss
                assert not os.path.exists(cache.path(h))
        assert cache.stats["corrupt_blocks"] == cache.stats["mismatched_blocks"] == 0
    m.stop()
    res = kvfs("fsck", str(m.backing), "--verify")
    assert " 0 added, 0 dropped, 0 updated, 0 partial files removed, 0 temporaries " \
           "removed, 0 quarantined, 0 orphans" in res.stdout, res.stdout
    m.start()


def test_sigkill_under_load(mount_factory, tmp_path):
    rounds = int(os.environ.get("KVFS_KILL_ROUNDS", "10"))
    m = mount_factory(extra=["--capacity", "16M", "--high-watermark", "0.9",
                             "--low-watermark", "0.7"])
    kvfs("tenant", "add", str(m.mnt), "fs", "--uid", "0", "--gid", "0")
    kvfs("tenant", "add", str(m.mnt), "kv", "--uid", "0", "--gid", "0")
    rng = random.Random(13)
    for round_ in range(rounds):
        kill_round(m, tmp_path, round_, rng)
    assert "ended without unmounting" in m.log_text()


def test_sigkill_while_a_notification_waits_on_a_lookup(mount_factory, monkeypatch):
    """The daemon's notifying thread waits in the kernel for a directory lock that a lookup
    (waiting on a lower tier that never answers) holds; then the daemon is killed. Without
    its watchdog the process never ends and the lookup hangs for ever; with it, both end and
    the mount point can be mounted again at once."""
    hole = socket.socket()  # an S3 endpoint that accepts connections and never answers
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    endpoint = f"http://127.0.0.1:{hole.getsockname()[1]}"
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    m = mount_factory(extra=[
        "--capacity", "1M", "--high-watermark", "1", "--low-watermark", "1",
        "--shared", f"s3://bucket?endpoint={endpoint}&read_timeout=300&connect_timeout=300"
                    "&max_attempts=1", "--fetch-timeout", "300", "--no-write-through"])
    kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
    fan = m.mnt / "t" / "ns" / "ab"
    fan.parent.mkdir()
    fan.mkdir(exist_ok=True)  # (a lookup with lower tiers makes a fan-out directory itself)
    for i in range(4):
        (fan / f"f{i}").write_bytes(b"x" * (250 << 10))
    missing = fan / hashing.block_filename(bytes.fromhex("ab" + "00" * 15))
    looker = subprocess.Popen(["stat", str(missing)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    pid = m.pid()
    try:
        time.sleep(1.5)  # its lookup waits on the tier, holding the directory's lock
        assert looker.poll() is None
        (m.mnt / "t" / "ns" / "g").write_bytes(b"y" * (300 << 10))  # evicts f0 from `fan`
        time.sleep(0.5)  # the invalidation of f0 now waits for that lock
        os.kill(pid, signal.SIGKILL)
        assert wait(lambda: not threads_alive(pid), 30), "the daemon did not end"
        assert wait(lambda: not mounted(m.mnt), 30), "the dead daemon's mount stayed"
        looker.wait(timeout=30)
    finally:
        if threads_alive(pid):  # (the defect: end it from outside, so that the test ends)
            force_unmount(m.mnt)
        looker.kill()
        hole.close()
    m.start()
    assert sorted(os.listdir(fan)) == ["f2", "f3"]  # f0 and f1 made room for g
    assert (m.mnt / "t" / "ns" / "g").read_bytes() == b"y" * (300 << 10)


def watchdog_of(pid: int) -> int | None:
    """The pid of daemon `pid`'s watchdog process (`python -m kvfs.daemon.watchdog PID ...`)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"kvfs.daemon.watchdog" in argv and str(pid).encode() in argv:
            return int(entry)
    return None


def test_a_late_watchdog_leaves_a_new_mount_alone(mount_factory):
    """The kernel gives a mount made right after another is gone the same mount id and device
    number. A dead daemon's watchdog that acts late (stopped here until the mount point is
    mounted again) must not take the new mount for its daemon's: it leaves it serving."""
    m = mount_factory()
    kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
    pid = m.pid()
    assert wait(lambda: watchdog_of(pid) is not None, 10)
    dog = watchdog_of(pid)
    before = watchdog.mount_device(str(m.mnt))
    os.kill(dog, signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGKILL)
        assert wait(lambda: not threads_alive(pid), 30), "the daemon did not end"
        force_unmount(m.mnt)
        m.start()
        if watchdog.mount_device(str(m.mnt)) != before:
            pytest.skip("this kernel gave the new mount another mount id or device number")
    finally:
        os.kill(dog, signal.SIGCONT)
    assert wait(lambda: not threads_alive(dog), 30), "the old watchdog did not end"
    assert mounted(m.mnt) and m.pid() != pid
    (m.mnt / "t" / "f").write_bytes(b"still here")
    assert (m.mnt / "t" / "f").read_bytes() == b"still here"
