"""``kvfs bench backends``: SGLang HiCache and LMCache storage backends, kvfs's against each
engine's own file backend, on the same data.

For each engine, in one process of the engines' venv (``.venv-engines``, built by
tools/setup_engines.sh), through the engine's own classes (:mod:`kvfs.integrations.drive`):

- SGLang 0.5.23: a real host KV pool (MHA, page-first, bfloat16, 32 layers x 64 tokens x 2
  heads x 128: pages of 2 MiB), the backend made by SGLang's storage factory: HiCacheFile
  (``file``, called on SGLang's generic page path as its controller calls it) on a directory
  of the plain filesystem, HiCacheFile on a directory of a kvfs mount over the same
  filesystem, and the kvfs backend (``dynamic``, zero-copy page forms) on that mount.
- LMCache 0.5.6: its StorageManager with its CPU backend, and LocalDiskBackend on the plain
  directory, LocalDiskBackend on the mount, or the kvfs plugin on the mount; chunks of
  4 MiB (32 layers x 256 tokens x 2 heads x 64, bfloat16).

``--total-mib`` (256) of pages or chunks are set (set throughput: median of ``--repeats``
sets, each under new keys, after a ``sync``), then the last set's are read back whole (get
throughput), warm (page cache holding the files; median of ``--repeats``) and cold
(``sync; echo 3 > /proc/sys/vm/drop_caches`` before each, root only); what a plan wrote is
removed after it. Each engine's process runs its plans ``--passes`` (3) + 1 times, the
backends taking turns, each pass on new data; each figure is the median of its passes but the
first (every pass is kept in the record's ``results``, the first as ``first_pass``): the first
warms the process for every backend alike, as a serving engine's long-lived process is warm,
and the turns give every backend its share of the machine's slow minutes. The ratios
are kvfs's backend over the engine's own file backend on the plain filesystem, measured in
the same run; the engine's file backend through the mount is the figure the issue started
from. kvfs's backend verifies every block it reads (xxh3 of the payload) and checksums every
block it writes, which the file backends do not: a fourth run with ``verify=sampled`` (one
block in 8 checksummed on reads; writes still checksum) shows what the verification costs.
A fifth run, the engine's file backend + xxh3 on the plain filesystem, is the floor of any
verified store: the file backend's same set and get plus one xxh3_64 pass over the same
bytes in the thread that does the I/O (HiCacheFile's is the calling thread; LocalDiskBackend's
are its thread pools, each hashing a chunk right before writing it or right after reading
it); kvfs's ratio against it is the part of the gap that is kvfs's own, the rest is the hash.
A sixth run is the physical floor of the machine: the same bytes, one file each, written with
one ``pwritev`` and read with one ``preadv`` where the engine holds them, by 4 threads, and
nothing else (:class:`kvfs.integrations.drive.RawFiles`); every backend's ratio to it is in
the row (``ratio_floor`` for kvfs, ``baseline_ratio_floor`` for the engine's own).
Beside each time, the CPU seconds of the engine's process (all its threads; the kvfs daemon's
are not included).
Every read is checked (the pages' count); bytes are checked by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from .common import finish
from .harness import Mount, can_drop_caches, conditions, median, mounted
from .records import Kind, figure_table

TENANT = "bench"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20


def _log(msg: str) -> None:
    print(f"[engines] {msg}", file=sys.stderr, flush=True)


def engines_python() -> str:
    py = os.path.join(ROOT, ".venv-engines", "bin", "python")
    if not os.path.exists(py):
        raise SystemExit("kvfs bench backends: no .venv-engines (run tools/setup_engines.sh)")
    return py


def _drive(engine: str, plans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    res = subprocess.run([engines_python(), "-m", "kvfs.integrations.drive", engine,
                          json.dumps(plans)], cwd=ROOT, capture_output=True, text=True)
    lines = res.stdout.strip().splitlines()
    if res.returncode != 0 or not lines:
        raise SystemExit(f"kvfs bench backends: the {engine} run failed:\n{res.stderr[-4000:]}")
    out = json.loads(lines[-1])
    for p, r in zip(plans, out, strict=True):
        if "error" in r:
            raise SystemExit(f"kvfs bench backends: {engine} {p['backend']} on {p.get('dir')}:"
                             f" {r['error']}")
    return out


def _plans(engine: str, mnt: str, plain: str, total_mib: int, repeats: int, cold: bool
           ) -> tuple[list[str], list[dict[str, Any]]]:
    if engine == "sglang":
        geo = {"layers": 32, "page_size": 64, "heads": 2, "head_dim": 128,
               "dtype": "bfloat16", "layout": "page_first", "model": "bench/model"}
        unit_mib = 2
        own = "HiCacheFile"
    else:
        geo = {"layers": 32, "chunk_size": 256, "heads": 2, "head_dim": 64,
               "dtype": "bfloat16", "model": "bench/model",
               "cpu_gb": 2 * total_mib / 1024 + 0.25,
               "disk_gb": repeats * total_mib / 1024 + 1}
        unit_mib = 4
        own = "LocalDiskBackend"
    base = geo | {"count": total_mib // unit_mib, "repeats": repeats,
                  "ops": ["bench", "clean"], "drop_caches": cold}
    names = [f"{own} on ext4", f"{own} through the mount", "kvfs backend",
             "kvfs backend, verify=sampled"]
    sampled = {"verify": "sampled"} if engine == "sglang" else {"kvfs.verify": "sampled"}
    plans = [base | {"backend": "file", "dir": os.path.join(plain, engine), "seed": "p"},
             base | {"backend": "file", "dir": os.path.join(mnt, TENANT, engine),
                     "seed": "m"},
             base | {"backend": "kvfs", "mount": mnt, "tenant": TENANT, "seed": "k"},
             base | {"backend": "kvfs", "mount": mnt, "tenant": TENANT, "seed": "s",
                     "extra": sampled}]
    # The verified-store floor: the same file backend, plus one xxh3_64 pass over the same
    # bytes in the thread doing the I/O (what any store that checksums every page or chunk
    # pays).
    names.append(f"{own} + xxh3 on ext4")
    plans.append(base | {"backend": "file", "dir": os.path.join(plain, f"{engine}-xxh3"),
                         "seed": "h", "hash": "xxh3_64"})
    # The physical floor: the same bytes, one file each, threaded pwritev / preadv and
    # nothing else (no engine code, no index, no hash).
    names.append("raw preadv/pwritev on ext4")
    plans.append(base | {"backend": "raw", "dir": os.path.join(plain, f"{engine}-raw"),
                         "seed": "r"})
    for p in plans:
        if p["backend"] in ("file", "raw"):
            os.makedirs(p["dir"], exist_ok=True)
    return names, plans


def run(args: argparse.Namespace) -> int:
    cold = args.cold and can_drop_caches()
    if args.cold and not cold:
        _log("not root: no cold-cache figures (dropping the page cache needs root)")
    work = tempfile.mkdtemp(prefix=".kvfs-bench-engines-", dir=args.work or os.getcwd())
    m = Mount.under(work)
    plain = os.path.join(work, "plain")
    os.makedirs(plain)
    m.start()
    mnt = str(m.mnt)
    rows: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    try:
        m.add_tenant(TENANT, 0, 0)
        cond = conditions([plain, mnt])
        for engine in args.engines:
            names, plans = _plans(engine, mnt, plain, args.total_mib, args.repeats, cold)
            _log(f"{engine}: {', '.join(names)}")
            t = time.monotonic()
            # Passes over the plans in one process, each on new data, the backends taking
            # turns within each (so that every backend meets the machine's slow minutes
            # alike): the first warms the process for every backend alike and is not
            # recorded (kept in "first_pass"; kvfs's first multi-threaded set of a process
            # ran up to 5x slower); each figure is the median of the other passes' figures.
            first = [p | {"seed": f"{p['seed']}-first"} for p in plans]
            timed = [p | {"seed": f"{p['seed']}-{k}"} for k in range(args.passes)
                     for p in plans]
            results = _drive(engine, first + timed)
            _log(f"{engine}: {time.monotonic() - t:.0f} s")
            n = len(plans)
            passes = [{name: r["bench"] for name, r in
                       zip(names, results[n * (k + 1):n * (k + 2)], strict=True)}
                      for k in range(args.passes)]
            raw[engine] = {name: {key: median([p[name][key] for p in passes])
                                  for key in passes[0][name]} for name in names}
            raw[engine]["first_pass"] = {name: r["bench"] for name, r in
                                         zip(names, results[:n], strict=True)}
            raw[engine]["passes"] = passes
            rows += _rows(engine, names, raw[engine])
    finally:
        m.stop(check=False)
        if not mounted(m.mnt):
            shutil.rmtree(work, ignore_errors=True)
    cond["load"] = "this machine is shared and was loaded by other work during the run"
    if args.note:
        cond["note"] = args.note
    record = {"benchmark": "backends", "conditions": cond, "rows": rows, "results": raw,
              "params": {"total_mib": args.total_mib, "repeats": args.repeats,
                         "passes": args.passes, "cold": cold, "sglang_page_mib": 2,
                         "lmcache_chunk_mib": 4}}
    return finish(record, args, _table(rows))


def _rows(engine: str, names: list[str], res: dict[str, dict[str, float]]
          ) -> list[dict[str, Any]]:
    own, mount, kvfs, sampled = names[:4]
    hashed = names[4] if len(names) > 4 else None
    floor = names[5] if len(names) > 5 else None
    rows = []
    for what, key in (("set", "set_s"), ("get warm", "get_warm_s"), ("get cold", "get_cold_s")):
        if key not in res[kvfs]:
            continue
        gbps = {n: res[n]["bytes"] / res[n][key] / 1e9 for n in names}
        ratio = gbps[kvfs] / gbps[own]
        note = (f"{mount}: {gbps[mount]:.3f} GB/s ({gbps[mount] / gbps[own]:.2f}x); kvfs "
                f"with verify=sampled: {gbps[sampled]:.3f} GB/s "
                f"({gbps[sampled] / gbps[own]:.2f}x)")
        row: dict[str, Any] = {"figure": f"{engine} {what}", "kvfs": round(gbps[kvfs], 3),
                               "baseline": round(gbps[own], 3), "baseline_name": own,
                               "ratio": round(ratio, 3), "unit": "GB/s", "target": ">= 1.0x",
                               "ok": ratio >= 1.0}
        if hashed is not None:
            # kvfs against the verified floor: the file backend plus one hash of the bytes.
            rh = gbps[kvfs] / gbps[hashed]
            row |= {"verified_baseline": round(gbps[hashed], 3),
                    "verified_baseline_name": hashed, "ratio_verified": round(rh, 3)}
            cost = 1 - gbps[hashed] / gbps[own]
            note = (f"vs {hashed}: {gbps[hashed]:.3f} GB/s, kvfs {rh:.2f}x of it "
                    + (f"(the hash alone costs the file backend {cost:.0%}); "
                       if cost >= 0.005 else "(the hash's cost to the file backend is "
                       "below this run's noise); ") + note)
        if floor is not None:
            # Both against the physical floor: what the same bytes cost with nothing but
            # the system calls.
            row |= {"floor": round(gbps[floor], 3), "floor_name": floor,
                    "ratio_floor": round(gbps[kvfs] / gbps[floor], 3),
                    "baseline_ratio_floor": round(gbps[own] / gbps[floor], 3)}
            note = (f"physical floor ({floor}): {gbps[floor]:.3f} GB/s, kvfs "
                    f"{gbps[kvfs] / gbps[floor]:.2f}x of it, {own} "
                    f"{gbps[own] / gbps[floor]:.2f}x; " + note)
        cpu = key.replace("_s", "_cpu_s")
        if all(cpu in res[n] for n in names):
            # CPU seconds of the engine's process (the daemon's are not in kvfs's): what each
            # backend costs the host, less at the mercy of other work than the wall clock.
            row |= {"kvfs_cpu_ms": round(res[kvfs][cpu] * 1e3, 1),
                    "baseline_cpu_ms": round(res[own][cpu] * 1e3, 1)}
            note = (f"process CPU: kvfs {res[kvfs][cpu] * 1e3:.0f} ms, {own} "
                    f"{res[own][cpu] * 1e3:.0f} ms"
                    + (f", {hashed} {res[hashed][cpu] * 1e3:.0f} ms" if hashed else "")
                    + "; " + note)
        rows.append(row | {"note": note})
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'figure':<20} {'kvfs GB/s':>10} {'own GB/s':>10} {'ratio':>7}  own through "
             "the mount"]
    for r in rows:
        lines.append(f"{r['figure']:<20} {r['kvfs']:>10.3f} {r['baseline']:>10.3f} "
                     f"{r['ratio']:>6.2f}x  {r['note']}")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", nargs="+", default=["sglang", "lmcache"],
                   choices=["sglang", "lmcache"])
    p.add_argument("--total-mib", type=int, default=256, help="data per backend (256)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed sets, and timed gets per state (3)")
    p.add_argument("--passes", type=int, default=3,
                   help="recorded passes over the backends, taking turns; median (3)")
    p.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure cold gets (root: drops the page cache)")
    p.add_argument("--work", help="directory for the mount and the plain directory "
                   "(default: here; the filesystem measured)")
    p.add_argument("--note", default="", help="a note on the conditions, kept in the record")


# -- the record, as `kvfs bench report` shows it --------------------------------------------


KIND = Kind("backends", "Engines' storage backends", "kvfs bench backends --out docs/bench", """\
`kvfs bench backends` (`kvfs/bench/backends.py`): SGLang 0.5.23 HiCache and LMCache 0.5.6, each
driven through its own classes in the engines' venv (`tools/setup_engines.sh`): SGLang's
storage factory over a real host KV pool (pages of 2 MiB, page-first, bfloat16), LMCache's
StorageManager (chunks of 4 MiB). For each, the engine's own file backend (HiCacheFile on its
generic page path; LocalDiskBackend) on a directory of the plain filesystem and on one of a
kvfs mount over the same filesystem, and kvfs's backend on that mount (SGLang: zero-copy page
forms; LMCache: the storage plugin), on the same amount of data (256 MiB). Set throughput
(median of the repeats, each under new keys after a `sync`), then get throughput warm (median
of the repeats) and cold (page cache dropped before each, root only), the median of three
passes over the backends in one process, the backends taking turns in each, after a first pass
that warms the process for all of them alike (each on other data; every pass's figures are in
the record's `results`). The ratio is kvfs's backend over the engine's file backend on the
plain filesystem, in the same run; the conditions column gives the file backend through the
mount. kvfs's backend checksums every block it writes and verifies every block it reads (xxh3
over the payload), which the file backends do not do; the conditions column also gives kvfs's
backend with `verify=sampled` (one read in 8 checksummed), so the price of the verification is
in the same run. It also gives the floor of any verified store, measured in the same run: the
file backend's same set and get plus one xxh3_64 pass over the same bytes in the thread doing
the I/O (`HiCacheFile + xxh3`: the calling thread; `LocalDiskBackend + xxh3`: its I/O pools,
each chunk hashed right before its write or after its read), and kvfs's ratio to it: what is
below 1.0x there is kvfs's own overhead, the rest of the gap to the unverified backend is the
hash. And the physical floor, in the same run: the same bytes, one file each, written with one
`pwritev` and read with one `preadv` by 4 threads where the engine holds them (LMCache: into
memory objects of its allocator), nothing else; kvfs's and the file backend's ratios to it
show how far from the machine's limit each is. Last, the CPU time of the engine's process for
each (the kvfs daemon's is not in it), which other work on a shared host disturbs less than
the wall clock.""",
            figure_table,
            ("kvfs", "baseline", "ratio", "verified_baseline", "ratio_verified", "floor",
             "ratio_floor", "baseline_ratio_floor"))
