"""What every benchmark record carries: the conditions it was measured under."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from typing import Any


def read_text(path: str) -> str:
    """A small file's text ('' when it cannot be read): /proc and /sys entries."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def cpu_model() -> str:
    for line in read_text("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def memory_gib() -> float:
    for line in read_text("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    return 0.0


#: Writing 1 drops the page cache, 2 dentries and inodes, 3 both (root only).
DROP_CACHES = "/proc/sys/vm/drop_caches"


def can_drop_caches() -> bool:
    """Whether this process may drop the kernel's caches (cold-cache figures need it)."""
    if os.getuid() != 0:
        return False
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("1")
    except OSError:
        return False
    return True


def busy_cpus(seconds: float = 1.0) -> float:
    """CPUs kept busy by other processes over ``seconds`` (this one sleeps meanwhile)."""
    def sample() -> tuple[int, int]:
        f = [int(x) for x in read_text("/proc/stat").splitlines()[0].split()[1:]]
        return sum(f) - f[3] - f[4], sum(f)

    b0, t0 = sample()
    time.sleep(seconds)
    b1, t1 = sample()
    return round((b1 - b0) / max(1, t1 - t0) * (os.cpu_count() or 1), 2)


def first_line(argv: list[str]) -> str | None:
    """The first line a command prints (a version, a commit), None if it fails."""
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = (res.stdout or res.stderr).strip().splitlines()
    return out[0] if res.returncode == 0 and out else None


def filesystem_of(path: str) -> dict[str, Any]:
    """Type, source, mount point and device kind of the filesystem holding `path`."""
    real = os.path.realpath(path)
    best: dict[str, str] = {}
    for line in read_text("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) < 5 or len(r) < 2:
            continue
        mnt = f[4].replace("\\040", " ")
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best.get("mnt", "")):
            best = {"mnt": mnt, "type": r[0], "source": r[1]}
    out: dict[str, Any] = {"type": best.get("type", "?"), "source": best.get("source", "?"),
                           "mountpoint": best.get("mnt"), "kind": "unknown device"}
    st = os.stat(real)
    sysdev = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    if os.path.exists(sysdev):
        blk = os.path.realpath(sysdev)
        if os.path.exists(os.path.join(blk, "partition")):
            blk = os.path.dirname(blk)
        name = os.path.basename(blk)
        rot = read_text(os.path.join(blk, "queue", "rotational")).strip()
        model = read_text(os.path.join(blk, "device", "model")).strip()
        out.update(
            device=name, model=model or None,
            rotational=rot == "1" if rot else None,
            read_ahead_kb=int(read_text(os.path.join(blk, "queue", "read_ahead_kb")).strip()
                              or 0),
            kind=("virtio disk" if "virtio" in blk else "NVMe SSD" if name.startswith("nvme")
                  else "device-mapper/RAID volume" if name.startswith(("dm-", "md"))
                  else "rotational disk" if rot == "1" else "SSD" if rot == "0"
                  else "unknown device"),
            size_gib=round(int(read_text(os.path.join(blk, "size")).strip() or 0) * 512 / 2**30,
                           1))
    else:
        out["kind"] = f"no block device ({out['type']})"
    return out


def conditions(dirs: list[str]) -> dict[str, Any]:
    """CPU, cores, memory, load, kernel, versions, and the filesystem of each directory."""
    import kvfs  # noqa: PLC0415

    versions = {"python": platform.python_version(), "kvfs": kvfs.__version__}
    for name in ("torch", "kvikio", "pyfuse3", "boto3"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - absent or broken: recorded as such
            versions[name] = None
    gpu = None
    try:
        import torch  # noqa: PLC0415

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    return {
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "cpu": cpu_model(), "cores": os.cpu_count(), "memory_gib": memory_gib(), "gpu": gpu,
        "load_average": os.getloadavg(), "kernel": platform.release(),
        "versions": versions, "filesystems": {d: filesystem_of(d) for d in dirs},
    }


def add_output_args(parser: Any) -> None:
    """The options every `kvfs bench` subcommand shares: where its record and plot go."""
    parser.add_argument("--out", default=".",
                        help="directory for BENCHMARK.json and BENCHMARK.png (default: here)")
    parser.add_argument("--json", help="write the JSON record here instead (plot beside it)")


def portable(value: Any) -> Any:
    """A record as it may be published: the paths of the machine that ran it (work
    directories, the trace's location, the checkout) reduced to their last component; the
    kvfs entry point named `kvfs`. Devices and mount points stay as they are."""
    if isinstance(value, dict):
        return {portable(k): portable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [portable(v) for v in value]
    if isinstance(value, str) and value.startswith("/") and value != "/" and not (
            value.startswith(("/dev/", "/proc/", "/sys/"))):
        if value.endswith(("/kvfs/cli.py", "/kvfs/cli/__main__.py", "/bin/kvfs")):
            return "kvfs"
        return os.path.basename(value.rstrip("/")) or value
    return value


def finish(record: dict[str, Any], args: Any, table: str) -> int:
    """Print the table, write the JSON record and its PNG plot; the tail of every subcommand.

    The record is the source of truth: `kvfs bench report` renders docs from records alone,
    and the plot is drawn from the record (never from state the record lacks).
    """
    import json  # noqa: PLC0415

    from . import plot  # noqa: PLC0415

    print(table)
    record.setdefault("command", list(sys.argv))  # how to reproduce it: `kvfs bench report`
    record = portable(record)
    name = record["benchmark"]
    path = args.json or os.path.join(args.out, f"{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    png = os.path.splitext(path)[0] + ".png"
    drawn = plot.draw(record, png)  # None when matplotlib is absent: said, not fatal
    record["plot"] = os.path.basename(png) if drawn else None
    with open(path, "w") as f:
        f.write(json.dumps(record, indent=2) + "\n")
    print(f"record: {path}" + (f"; plot: {png}" if drawn else
                               "; no plot (matplotlib is not installed, or the log says why)"))
    return 0
