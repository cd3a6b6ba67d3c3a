"""The CPUs the client's I/O threads run on.

An engine may bind its own threads to cores: vLLM's CPU build pins its main thread to the
model's cores through OpenMP (``OMP_PROC_BIND``, ``GOMP_CPU_AFFINITY``), and every thread that
thread starts afterwards inherits the binding. A restore's reads, GETs, deciphering and checks
would then share the model's core while the others idle, although the model waits for the
restore. The client's pools therefore start their threads on every CPU the process may use
(the kernel keeps them within the cgroup's cpuset). ``KVFS_IO_CPUS`` chooses otherwise: a list
of CPUs (``0-3,8``), or ``inherit`` to keep the binding of the thread that starts them.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

ENV = "KVFS_IO_CPUS"


def parse(text: str) -> set[int]:
    """CPUs written as Linux writes them (``0-3,8``); ValueError if malformed or empty."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if first < 0 or last < first:
            raise ValueError(f"{part!r} is not a CPU or a range of CPUs")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError("no CPU named")
    return cpus


def wanted() -> set[int] | None:
    """The CPUs the client's I/O threads should run on; None: leave them as they start."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    choice = os.environ.get(ENV, "").strip()
    if choice == "inherit":
        return None
    if choice:
        try:
            return parse(choice)
        except ValueError as exc:
            log.warning("%s=%r ignored: %s", ENV, choice, exc)
    return set(range(os.cpu_count() or 1))


def spread() -> None:
    """A pool's thread initializer: run this thread on :func:`wanted`'s CPUs (never fails)."""
    cpus = wanted()
    if cpus is None:
        return
    try:
        if os.sched_getaffinity(0) != cpus:
            os.sched_setaffinity(0, cpus)  # the kernel drops what the cpuset does not allow
    except OSError as exc:  # none of them allowed here: keep the binding it started with
        log.debug("I/O thread kept its CPUs (%s)", exc)
