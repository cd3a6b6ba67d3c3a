"""Benchmark the kvfs mount against its own backing filesystem, from a checkout:
``python tools/bench_mount.py [OPTIONS]`` (``--quick``: a smoke run; ``--help``: the options).

The benchmark lives in the product (:mod:`kvfs.bench.mount`, its phases in
:mod:`kvfs.bench.mount_phases`). This wrapper measures the checkout's kvfs, in this process
and in the daemons it mounts, whether or not that kvfs is installed.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_this_checkout() -> None:
    """Import kvfs from this checkout, here and in every daemon started (PYTHONPATH)."""
    if os.path.isdir(os.path.join(REPO, "kvfs")) and REPO not in sys.path:
        sys.path.insert(0, REPO)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [REPO, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


if __name__ == "__main__":
    use_this_checkout()
    from kvfs.bench.mount import main

    sys.exit(main())
