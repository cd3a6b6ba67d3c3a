"""What every benchmark record carries: the conditions it was measured under."""

from __future__ import annotations

import os
import platform
import time
from typing import Any


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def filesystem_of(path: str) -> dict[str, str]:
    """Type and source of the filesystem holding `path` (longest mount point that holds it)."""
    real, best = os.path.realpath(path), ("", "?", "?")
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) > 4 and len(r) > 1:
            mnt = f[4].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, r[0], r[1])
    return {"mountpoint": best[0], "type": best[1], "source": best[2]}


def conditions(dirs: list[str]) -> dict[str, Any]:
    """CPU, cores, memory, load, kernel, versions, and the filesystem of each directory."""
    import kvfs  # noqa: PLC0415

    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.machine())
    mem = next((int(line.split()[1]) // 1024 for line in _read("/proc/meminfo").splitlines()
                if line.startswith("MemTotal:")), 0)
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
        "cpu": cpu, "cores": os.cpu_count(), "memory_mib": mem, "gpu": gpu,
        "load_average": os.getloadavg(), "kernel": platform.release(),
        "versions": versions, "filesystems": {d: filesystem_of(d) for d in dirs},
    }
