"""The kvfs client of another host, for test_hosts: run where that host's network is (for
example behind ``nsenter --net=/run/netns/NAME``), driven over stdin and stdout.

    python hostload.py MNT TENANT MODEL

Each line read is a JSON list of hex block hashes (a context, in order); for each, a
``lookup`` and a ``load`` of what it found, the loaded KV checked against kvload's content
of each block, and one JSON line written: {"found", "loaded", "right", "seconds"}.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from kvload import content, spec  # a script beside kvload.py

import kvfs as kv


def main(argv: list[str]) -> None:
    mnt, tenant, model = argv[:3]
    sp = spec(model)
    print("ready", flush=True)
    for line in sys.stdin:
        hashes = [bytes.fromhex(h) for h in json.loads(line)]
        with kv.KVCache.open(mnt, tenant=tenant, spec=sp) as cache:
            t = time.monotonic()
            found = cache.lookup(hashes)
            out = torch.zeros(len(hashes), *sp.block_shape, dtype=torch.float16)
            loaded = cache.load(hashes[:found], out) if found else 0
            seconds = time.monotonic() - t
            cache.flush()
        right = bool(torch.equal(out[:loaded], content(sp, hashes[:loaded])))
        print(json.dumps({"found": found, "loaded": loaded, "right": right,
                          "seconds": round(seconds, 3)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
