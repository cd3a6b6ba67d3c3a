"""`kvfs bench restore`, from a checkout: ``python tools/bench_restore.py [OPTIONS]``.

The benchmark lives in the product (`kvfs/bench/restore.py`; `kvfs bench restore --help`
lists the options). This wrapper runs the checkout's kvfs, in this process and in the daemon
it mounts, whether or not that kvfs is installed.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    sys.path.insert(0, REPO)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [REPO, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    from kvfs.cli import main

    sys.exit(main(["bench", "restore", *sys.argv[1:]]))
