"""Benchmark the lower tiers, from a checkout: ``python tools/bench_tiers.py [OPTIONS]``
(``--quick``: a smoke run; ``--out docs/bench``: tiers.json and tiers.png there).

Restores from hot, cold directory and shared S3, and request latency while the store is slow
or down. The benchmark lives in the product (:mod:`kvfs.bench.tiers`, with
:mod:`kvfs.bench.tiers_restore` and :mod:`kvfs.bench.tiers_latency`). This wrapper measures
the checkout's kvfs, in this process and in the daemons it mounts, whether or not that kvfs
is installed.
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
    from kvfs.bench.tiers import main

    sys.exit(main())
