"""The machine a benchmark record was measured on, in one schema (:func:`conditions`,
:func:`conditions_after`, :data:`CONDITION_KEYS`): CPU, memory, kernel, the filesystems and
their devices, versions, the kvfs commit, the load, and the proactive reclaim the host runs.
Re-exported by :mod:`kvfs.bench.harness`. Stdlib only at import.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Writing 1 drops the page cache, 2 dentries and inodes, 3 both (root only).
DROP_CACHES = "/proc/sys/vm/drop_caches"


# -- the machine ------------------------------------------------------------------------------


def read_text(path: str | Path) -> str:
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


def _sys_int(path: Path) -> int:
    """A sysfs file's integer (0 where it is absent or not one)."""
    try:
        return int(read_text(path).strip() or 0)
    except ValueError:
        return 0


def page_reclaim(sysfs: str = "/sys") -> str | None:
    """The proactive reclaim that runs on this machine, in words, or None: a DAMON scheme
    that pages out memory left idle (a virtual machine's host often sets one), which drops
    page cache a benchmark calls warm once it has been idle that long."""
    found = []
    for kd in sorted(Path(sysfs, "kernel/mm/damon/admin/kdamonds").glob("[0-9]*")):
        if read_text(kd / "state").strip() != "on":
            continue
        for ctx in sorted(kd.glob("contexts/[0-9]*")):
            aggr_us = _sys_int(ctx / "monitoring_attrs/intervals/aggr_us")
            for sch in sorted(ctx.glob("schemes/[0-9]*")):
                action = read_text(sch / "action").strip()
                if action not in ("pageout", "lru_deprio"):
                    continue
                spare_anon = any(read_text(f / "type").strip() == "anon"
                                 and read_text(f / "allow").strip() == "N"
                                 for f in sch.glob("ops_filters/[0-9]*"))
                age_s = _sys_int(sch / "access_pattern/age/min") * aggr_us / 1e6
                text = (f"DAMON {action} of {'page cache' if spare_anon else 'memory'} "
                        f"idle for {age_s:g} s or more")
                quota, reset_ms = _sys_int(sch / "quotas/bytes"), _sys_int(
                    sch / "quotas/reset_interval_ms")
                if quota and reset_ms:
                    text += f", up to {quota / 2**20 / (reset_ms / 1000):g} MiB/s"
                found.append(text)
    params = Path(sysfs, "module/damon_reclaim/parameters")
    if read_text(params / "enabled").strip() == "Y":
        age_us = _sys_int(params / "min_age")
        found.append("DAMON_RECLAIM"
                     + (f" of memory idle for {age_us / 1e6:g} s or more" if age_us else ""))
    return "; ".join(found) or None


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


def ext4_journal(device: str, sysfs: str = "/sys") -> bool | None:
    """Whether the ext4 filesystem on block device ``device`` (``vda``, ``nvme0n1p2``) has a
    journal; None where that is not known (not ext4, no sysfs). Without one, ext4 gives no
    new file an inode deleted in the last minute: each create walks past every such inode
    (``recently_deleted``), so creates right after many files were removed cost hundreds of
    microseconds more (600-800 us for an empty file on a VM that had just removed a few
    thousand, against tens of microseconds otherwise)."""
    task = read_text(Path(sysfs, "fs/ext4", device, "journal_task")).strip()
    if not task:
        return None
    return task != "<none>"


def filesystem_of(path: str | Path) -> dict[str, Any]:
    """Type, source, mount point and device kind of the filesystem holding `path` (and, for
    ext4, whether it has a journal)."""
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
        if out["type"] == "ext4":
            out["journal"] = ext4_journal(os.path.basename(blk))
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


# -- the conditions schema ----------------------------------------------------------------------

#: Every key a record's ``conditions`` may hold with a meaning of its own (`kvfs bench report`
#: renders these by name; any other key is listed as it is, as a benchmark's extra).
CONDITION_KEYS = (
    "time", "cpu", "cores", "cores_usable", "memory_gib", "gpu", "kernel", "filesystems",
    "versions", "kvfs_commit", "kvfs_local_changes", "root", "cold_cache", "load_average",
    "other_busy_cpus_before", "load_average_after", "other_busy_cpus_after", "page_reclaim")
#: The modules whose versions every record carries (None: not installed).
VERSIONS = ("torch", "kvikio", "pyfuse3", "boto3")


def _version(name: str) -> str | None:
    try:
        module = __import__(name)
    except Exception:  # noqa: BLE001 - absent or broken: recorded as such
        return None
    v = getattr(module, "__version__", None) or getattr(module, "VERSION", None)
    return None if v is None else str(v)


def kvfs_checkout() -> tuple[str | None, list[str]]:
    """The commit of the kvfs measured and the files of its package changed since, when it
    runs from a git checkout; (None, []) otherwise."""
    import kvfs  # noqa: PLC0415

    pkg = os.path.dirname(os.path.abspath(kvfs.__file__))
    commit = first_line(["git", "-C", pkg, "rev-parse", "--short", "HEAD"])
    if commit is None:
        return None, []
    res = subprocess.run(["git", "-C", pkg, "status", "--porcelain", "--", "."],
                         capture_output=True, text=True)
    return commit, [line[3:] for line in res.stdout.splitlines() if line.strip()]


def conditions(dirs: Sequence[str] | dict[str, str], *, modules: Sequence[str] = VERSIONS,
               tools: dict[str, list[str]] | None = None, gpu: bool = True,
               load: bool = False) -> dict[str, Any]:
    """The machine a record was measured on, in the one schema of :data:`CONDITION_KEYS`.

    ``dirs``: the directories whose filesystems matter (a dict names them; a list keeps the
    path as the label). ``modules``: Python modules whose versions to record (importing
    torch costs seconds: a benchmark that does not use it leaves it out); ``tools``: name ->
    argv printing a version (fio, weed). ``gpu``: ask torch for a GPU. ``load``: also sample
    the CPUs other processes keep busy (one second). Add :func:`conditions_after` at the end.
    """
    import kvfs  # noqa: PLC0415

    versions: dict[str, Any] = {"python": platform.python_version(), "kvfs": kvfs.__version__}
    for name in modules:
        versions[name] = _version(name)
    for name, argv in (tools or {}).items():
        versions[name] = first_line(argv) if shutil.which(argv[0]) else None
    found_gpu = None
    if gpu and "torch" in modules:
        try:
            import torch  # noqa: PLC0415

            if torch.cuda.is_available():
                found_gpu = torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001
            pass
    labelled = dirs if isinstance(dirs, dict) else {d: d for d in dirs}
    commit, changed = kvfs_checkout()
    out: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "cpu": cpu_model(), "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)), "memory_gib": memory_gib(),
        "gpu": found_gpu, "kernel": platform.release(),
        "filesystems": {k: filesystem_of(v) for k, v in labelled.items()},
        "versions": versions, "kvfs_commit": commit, "kvfs_local_changes": changed,
        "root": os.getuid() == 0, "load_average": [round(x, 2) for x in os.getloadavg()],
        "page_reclaim": page_reclaim(),
    }
    if load:
        out["other_busy_cpus_before"] = busy_cpus()
    return out


def conditions_after(cond: dict[str, Any], *, load: bool = False) -> dict[str, Any]:
    """Add the load at the end of the run to ``cond`` (and return it)."""
    if load:
        cond["other_busy_cpus_after"] = busy_cpus()
    cond["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return cond
