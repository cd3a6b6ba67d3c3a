"""Which CPU the kernel wakes the daemon on for a FUSE request: the `fuse` module's
`wake_here` parameter, where the kernel has one.

A FUSE request is a round trip: the caller's task queues it and sleeps, the kernel wakes the
daemon's thread blocked reading /dev/fuse, the daemon answers, the kernel wakes the caller.
Woken on another CPU, the daemon waits for that CPU to come out of idle (on a virtual
machine an inter-processor interrupt through the hypervisor): on the 2-core VM kvfs is
measured on, a request the request thread answers took 45-53 us that way. Some kernels carry a
`fuse` module parameter, `/sys/module/fuse/parameters/wake_here`, that wakes the daemon's
reader on the caller's CPU instead (the caller is about to sleep waiting for the answer): the
same request then takes 9 us (measured with the daemon pinned to one CPU and the caller on the
other, which turns it back into 48-51 us, and both on one CPU, 9-12 us with it on or off).

The parameter is the host's, shared by every FUSE filesystem on it, not the mount's. A mount
run as root turns it on (`--wake-here on`, the default) and says so in its log once; it is
not turned back at unmount (other mounts may rely on it). `--wake-here off` turns it off,
`--wake-here keep` leaves it as it is. stats.json (`fuse_wake`) and `kvfs status` say what
it is now and what this mount did. A kernel without it has nothing to set.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

#: The parameter (absent from kernels that do not have it).
PARAM = "/sys/module/fuse/parameters/wake_here"
#: What `--wake-here` takes.
CHOICES = ("on", "off", "keep")


def read(path: str = PARAM) -> str | None:
    """"on", "off", or None where this kernel has no such parameter (or it cannot be read)."""
    try:
        with open(path) as f:
            value = f.read().strip()
    except OSError:
        return None
    return "on" if value in ("Y", "1") else "off" if value in ("N", "0") else None


def apply(want: str, path: str = PARAM) -> str:
    """Set the parameter as `want` (CHOICES) asks, once, at mount; what this mount did, in
    words (for the log, stats.json and `kvfs status`). Never raises: a host that refuses
    keeps its setting and the mount goes on."""
    now = read(path)
    if now is None:
        return "this kernel has no fuse.wake_here parameter"
    if want == "keep" or want == now:
        return f"left {now} (--wake-here {want})"
    try:
        with open(path, "w") as f:
            f.write("Y" if want == "on" else "N")
    except OSError as exc:
        log.warning("could not turn fuse.wake_here %s (%s): FUSE requests wake the daemon "
                    "on %s", want, exc.strerror,
                    "the caller's CPU" if now == "on" else "another CPU (slower round trips)")
        return f"left {now}: turning it {want} was refused ({exc.strerror})"
    got = read(path)
    if got != want:
        return f"left {got}: turning it {want} did not hold"
    log.info("fuse.wake_here turned %s (host-wide, kept after unmount): FUSE requests wake the "
             "daemon on %s", want,
             "the caller's CPU (a round trip several times shorter on a VM)" if want == "on"
             else "any CPU")
    return f"turned {want} by this mount"


def snapshot(done: str, path: str = PARAM) -> dict[str, Any]:
    """stats.json `fuse_wake`: the parameter now ("on", "off", None: not in this kernel)
    and what this mount did."""
    return {"wake_here": read(path), "mount": done}
