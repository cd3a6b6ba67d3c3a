"""The phases of the mount benchmark (:mod:`kvfs.bench.mount`): metadata, and the scale of a
million-file index, each through a kvfs mount and against the same work on its backing
filesystem, in the same run. (Sequential reads and writes through the mount are the mount
door benchmark's, :mod:`kvfs.bench.door`: whole files and the engines' patterns, warm and
cold, against a plain directory of the same filesystem.)
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from .harness import Mount, drop_caches, log, quantile, read_text, settle

MiB = 1024 * 1024
CHUNK = 1 * MiB
TENANT = "bench"


def read_ahead_kb(path: str) -> int | None:
    """The read-ahead window of the bdi behind `path` (a FUSE mount has its own)."""
    st = os.stat(path)
    text = read_text(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb")
    return int(text) if text.strip() else None


def new_mount(work: str, prefix: str) -> Mount:
    """A mount of ``work/PREFIX-backing`` at ``work/PREFIX-mnt``, logging to
    ``work/PREFIX-daemon.log``."""
    m = Mount(os.path.join(work, f"{prefix}-backing"), os.path.join(work, f"{prefix}-mnt"),
              os.path.join(work, f"{prefix}-daemon.log"))
    os.makedirs(m.backing, exist_ok=True)
    os.makedirs(m.mnt, exist_ok=True)
    return m


def stop(m: Mount) -> float:
    """Unmount (the daemon may take its time: 600 s); one that fails is unmounted by force."""
    try:
        return m.stop(timeout=600)
    except RuntimeError as exc:
        log(f"WARNING: {exc.args[0].strip()}; unmounted by force")
        return 0.0


# -- throughput ------------------------------------------------------------------------------


# -- metadata --------------------------------------------------------------------------------


def _create(paths: Sequence[str]) -> float:
    t = time.perf_counter()
    for p in paths:
        os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    return time.perf_counter() - t


def _stat(paths: Sequence[str]) -> float:
    t = time.perf_counter()
    for p in paths:
        os.lstat(p)
    return time.perf_counter() - t


def _ls(path: str, flags: str = "-l") -> float:
    env = dict(os.environ, LC_ALL="C")
    t = time.perf_counter()
    with open(os.devnull, "wb") as null:
        subprocess.run(["ls", flags, path], stdout=null, check=True, env=env)
    return time.perf_counter() - t


def bench_meta(args: argparse.Namespace, work: str, cold: bool) -> dict[str, Any]:
    n = args.meta_files
    m = new_mount(work, "md")
    plain_dir = os.path.join(work, "md-plain", "dir")
    os.makedirs(plain_dir)
    out: dict[str, Any] = {"files": n, "dentry_cache": "dropped before stat and the first "
                           "ls -l" if cold else "not dropped (not root)"}
    m.start()
    try:
        os.mkdir(os.path.join(m.mnt, TENANT), 0o755)
        mount_dir = os.path.join(m.mnt, TENANT, "dir")
        os.mkdir(mount_dir, 0o755)
        names = [f"file-{i:07d}" for i in range(n)]
        pid = m.pid()

        def cool(key: str) -> None:
            if cold:
                drop_caches(2)
                out[f"daemon_settle_{key}_s"] = settle(pid)

        for side, d in (("mount", mount_dir), ("backing", plain_dir)):
            paths = [os.path.join(d, x) for x in names]
            out[f"create_{side}_s"] = _create(paths)
            log(f"create {n} {side:7s}: {out[f'create_{side}_s']:.2f} s")
            cool(f"stat_{side}")
            out[f"stat_{side}_s"] = _stat(paths)
            log(f"stat   {n} {side:7s}: {out[f'stat_{side}_s']:.2f} s")
            cool(f"ls_{side}")
            out[f"ls_cold_{side}_s"] = _ls(d)
            out[f"ls_warm_{side}_s"] = _ls(d)
            log(f"ls -l  {n} {side:7s}: {out[f'ls_cold_{side}_s']:.2f} s "
                f"(then {out[f'ls_warm_{side}_s']:.2f} s again)")
            cool(f"lsf_{side}")
            out[f"ls_names_{side}_s"] = _ls(d, "-f")
            log(f"ls -f  {n} {side:7s}: {out[f'ls_names_{side}_s']:.2f} s (names only)")
        if cold:
            log(f"daemon busy after dropping {n} dentries (FORGETs): "
                f"{out['daemon_settle_stat_mount_s']:.1f} s")
    finally:
        stop(m)
    check_log(m, out)
    return out


# -- scale -----------------------------------------------------------------------------------


def scale_path(i: int, dirs: int) -> str:
    return os.path.join(TENANT, "ns", f"{i % dirs:02x}", f"f{i:08d}.dat")


def _make_files(job: tuple[str, list[int], int, int]) -> int:
    root, indices, dirs, nbytes = job
    payload = b"k" * nbytes
    for i in indices:
        fd = os.open(os.path.join(root, scale_path(i, dirs)),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        if payload:
            os.write(fd, payload)
        os.close(fd)
    return len(indices)


def make_tree(root: str, n: int, dirs: int, nbytes: int) -> float:
    """n small files under root/bench/ns/<hh>/, as fast as this machine can make them."""
    t = time.perf_counter()
    for d in range(dirs):
        os.makedirs(os.path.join(root, TENANT, "ns", f"{d:02x}"))
    workers = max(1, len(os.sched_getaffinity(0)))
    per = max(1, -(-n // (workers * 8)))
    jobs = [(root, list(range(i, min(n, i + per))), dirs, nbytes) for i in range(0, n, per)]
    # Workers take SIGTERM's default action: this process's handler (raise SystemExit)
    # would leave a worker stuck on the pool's lock when the pool terminates it.
    with multiprocessing.get_context("fork").Pool(
            workers, initializer=signal.signal, initargs=(signal.SIGTERM, signal.SIG_DFL)
    ) as pool:
        made = sum(pool.imap_unordered(_make_files, jobs))
    assert made == n
    os.sync()
    return time.perf_counter() - t


def _lookup_latencies(paths: Sequence[str]) -> list[float]:
    out = []
    for p in paths:
        t = time.perf_counter_ns()
        os.stat(p)
        out.append((time.perf_counter_ns() - t) / 1000)
    return out


def percentiles(us: list[float]) -> dict[str, float]:
    """p50 and p99 (nearest rank), mean and count of lookup latencies."""
    return {"p50_us": quantile(us, 0.5) or 0.0, "p99_us": quantile(us, 0.99) or 0.0,
            "mean_us": sum(us) / len(us), "n": len(us)}


def _walk_peer(root: str) -> float:
    """A peer doing the walk the first mount must do: find(1) stats every entry."""
    t = time.perf_counter()
    with open(os.devnull, "wb") as null:
        subprocess.run(["find", root, "-printf", "%s %m %U %G %T@\\n"], stdout=null,
                       check=True)
    return time.perf_counter() - t


def bench_scale(args: argparse.Namespace, work: str, cold: bool) -> dict[str, Any]:
    n, dirs = args.scale_files, args.scale_dirs
    out: dict[str, Any] = {"files": n, "dirs": dirs, "file_bytes": args.scale_file_bytes,
                           "lookups": args.scale_lookups,
                           "caches": "page cache and dentries dropped before each mount and "
                           "the walk; dentries dropped before each set of lookups"
                           if cold else "not dropped (not root)"}

    def cool(level: int) -> None:
        if cold:
            drop_caches(level)

    # The fixed cost: a mount of an empty backing directory.
    empty = Mount(os.path.join(work, "sc-empty"), os.path.join(work, "sc-empty-mnt"),
                  os.path.join(work, "sc-empty.log"))
    os.makedirs(empty.backing)
    os.makedirs(empty.mnt)
    cool(3)
    out["mount_empty_s"] = empty.start()
    try:
        out["rss_empty_mib"] = empty.memory()
    finally:
        stop(empty)
    log(f"mount of an empty backing dir: {out['mount_empty_s']:.2f} s, "
        f"daemon RSS {out['rss_empty_mib']['VmRSS']:.0f} MiB")

    m = new_mount(work, "sc")
    log(f"creating {n} files in {dirs} directories ...")
    out["create_tree_s"] = make_tree(m.backing, n, dirs, args.scale_file_bytes)
    log(f"created {n} files in {out['create_tree_s']:.1f} s "
        f"({n / out['create_tree_s']:.0f} files/s)")
    cool(3)
    out["walk_find_s"] = _walk_peer(m.backing)
    log(f"find(1) walk with stat of the tree: {out['walk_find_s']:.2f} s")

    rng = random.Random(args.seed)
    k = min(args.scale_lookups, n)
    picks = rng.sample(range(n), 2 * k) if 2 * k <= n else [rng.randrange(n)
                                                           for _ in range(2 * k)]
    first, second = picks[:k], picks[k:]
    during = [rng.randrange(n) for _ in range(min(k, 2000))]
    try:
        cool(3)
        out["mount_first_s"] = m.start()
        served = time.perf_counter()
        # Lookups while the tree is being indexed: each names a directory that the request
        # may have to index first (a listing of n/dirs files), or that the background has.
        lat = _lookup_latencies([os.path.join(m.mnt, scale_path(i, dirs)) for i in during])
        out["lookup_mount_indexing"] = percentiles(lat)
        log(f"first mount (serving at once, indexing the tree meanwhile): "
            f"{out['mount_first_s']:.2f} s; {len(during)} lookups meanwhile: p50 "
            f"{out['lookup_mount_indexing']['p50_us']:.0f} us p99 "
            f"{out['lookup_mount_indexing']['p99_us']:.0f} us")
        while m.stats()["indexing"]["directories_left"]:
            time.sleep(0.1)
        out["index_complete_s"] = out["mount_first_s"] + time.perf_counter() - served
        st = m.stats()
        out["files_indexed"] = st["files"]
        out["rss_after_first_mount_mib"] = m.memory()
        log(f"tree indexed {out['index_complete_s']:.1f} s after the mount began: "
            f"{st['files']} files, daemon RSS "
            f"{out['rss_after_first_mount_mib']['VmRSS']:.0f} MiB "
            f"(peak {out['rss_after_first_mount_mib']['VmHWM']:.0f} MiB)")
        cool(2)
        if cold:
            settle(m.pid())
        lat = _lookup_latencies([os.path.join(m.mnt, scale_path(i, dirs)) for i in first])
        out["lookup_mount_first"] = percentiles(lat)
        out["rss_after_lookups_first_mib"] = m.memory()
        cool(2)
        lat = _lookup_latencies([os.path.join(m.backing, scale_path(i, dirs)) for i in first])
        out["lookup_backing"] = percentiles(lat)
        log(f"lookups: mount p50 {out['lookup_mount_first']['p50_us']:.0f} us p99 "
            f"{out['lookup_mount_first']['p99_us']:.0f} us; backing p50 "
            f"{out['lookup_backing']['p50_us']:.0f} us p99 "
            f"{out['lookup_backing']['p99_us']:.0f} us; daemon RSS "
            f"{out['rss_after_lookups_first_mib']['VmRSS']:.0f} MiB")
        out["umount_s"] = stop(m)
        db = os.path.join(m.backing, ".kvfs", "index.db")
        out["index_mib"] = sum(os.path.getsize(p) / MiB for p in (db, db + "-wal")
                               if os.path.exists(p))
        log(f"clean unmount: {out['umount_s']:.2f} s; index {out['index_mib']:.0f} MiB")

        cool(3)
        out["mount_second_s"] = m.start()
        out["rss_after_second_mount_mib"] = m.memory()
        log(f"second mount (index trusted): {out['mount_second_s']:.2f} s, daemon RSS "
            f"{out['rss_after_second_mount_mib']['VmRSS']:.0f} MiB")
        cool(2)
        if cold:
            settle(m.pid())
        lat = _lookup_latencies([os.path.join(m.mnt, scale_path(i, dirs)) for i in second])
        out["lookup_mount_second"] = percentiles(lat)
        out["rss_after_lookups_second_mib"] = m.memory()
        log(f"lookups after the second mount: p50 "
            f"{out['lookup_mount_second']['p50_us']:.0f} us p99 "
            f"{out['lookup_mount_second']['p99_us']:.0f} us; daemon RSS "
            f"{out['rss_after_lookups_second_mib']['VmRSS']:.0f} MiB")
    finally:
        stop(m)
    text = m.log_text()
    out["reconciled_on_second_mount"] = text.count("not closed cleanly") > 1
    for line in text.splitlines():
        if "fsck:" in line and "entries checked" in line:
            out["fsck_log"] = line.split("fsck: ", 1)[1]
    check_log(m, out)
    return out


def check_log(m: Mount, out: dict[str, Any]) -> None:
    text = m.log_text()
    if "Traceback" in text or " ERROR " in text:
        out["daemon_log_errors"] = True
        log(f"WARNING: the daemon log {os.path.basename(m.log)} has errors:\n{text[-3000:]}")
