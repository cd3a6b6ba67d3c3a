"""`kvfs bench door`: the mount door, what an engine without a kvfs backend pays for pointing
its file backend at the mount instead of at a plain directory of the same filesystem.

One run mounts kvfs over a fresh directory of the filesystem measured (`--dir`) and makes a
plain directory beside it. Each file pattern of the engines of docs/engines.md is replayed on
both sides, the two sides alternating within each repeat so that both see the same load:

- **small**: create-heavy small files: N files of 128 KiB, each created, written, closed;
- **vllm**: vLLM's fs tier and llm-d: `exists()`, a temporary created with
  `O_CREAT|O_EXCL|O_WRONLY|O_TRUNC|O_DIRECT`, written, closed, `os.replace`d onto its name;
  loaded with `O_DIRECT` and `readv` (buffered on a side that refuses O_DIRECT: recorded);
- **sglang**: SGLang's HiCacheFile: one file per page, `exists()` before each set, a
  temporary renamed into place; get: `open` + `readinto`;
- **lmcache**: LMCache's LocalDiskBackend: written in place at the final name, read with
  `readinto`; **lmcache-direct**: the same with `use_odirect`;
- **file-2m**, **file-32m**, **file-256m**: whole files, each written and read in one call;
  **file-chunked**: 32 MiB files written and read in calls of 128 KiB, as `cp`, `cat` and
  `dd` move them.

Before the patterns the mount and the plain directory are *aged* (`--aged`, 20,000 by
default): that many empty files created and closed in a directory of their own, so that the
patterns meet the mount as a cache in use does (more files than its request thread keeps
delegated), not as a fresh one. (Not the peer below: it holds an fd for every inode the
kernel knows, which an open-file limit of 20,000 would not take.)

For each: the time of the writes (for small files: per create+write+close; each side's
writes start after a `sync`, so that none meets the write-back of what was written before
it), then reads of
every file just written (warm: the page cache as the writer left it), then reads after the
caches were dropped (`echo 3 > drop_caches` on both sides alike, after the daemon has handled
the FORGETs; root only). Ratios are the mount's against the plain directory's: throughput
ratios for writes and reads, a time ratio for creates. Medians of the repeats. The small
files stay until the end of the run: on an ext4 without a journal (the record says so) a
create walks past every inode removed in the last minute, so removing each repeat's thousands
of files would slow the next repeat's creates on every side (for the same reason, leave a
minute between two runs on such a filesystem: the first removes its files at its end).

`--variant NAME=ARGS` repeats the whole run with other `kvfs mount` arguments (an option on
and off, in one record). The floor under a Python FUSE daemon is measured in the same run:
the time of a bare FUSE round trip (`fstat` of a file whose attributes the kernel may not
cache, served by the daemon without any work) against the same `fstat` on the plain side,
the round trip of a request the mount's request thread answers in C (a `getxattr` outside
`user.`, where the thread runs) and the time of an open and close it answers (against a
plain one: an open waits for its OPEN, a close wakes the thread for its RELEASE), the `stat`
of a name missing from a model directory (an engine's `exists()` that misses, and the lookup
before every create: the thread's, once the daemon's first miss there has handed the
directory over) against the same on the plain side, the FUSE
requests each phase costs per file (counted by
the daemon; `thread_<kind>` for those its request thread answered), the bytes that crossed
the FUSE channel, the time of one `memcpy` of a file's bytes (round trip and copy: before and
after the patterns, the faster), and the daemon's CPU time per file written and per file read
warm.

From these each figure gets its **floor**: the best ratio a daemon sent the requests kvfs was
sent could reach, answering each at this round trip (a daemon in C answers faster and may be
sent fewer: the peer below shows what one gets). Through the mount the backing filesystem
still does what the plain directory does (the daemon creates, writes and reads the backing
file; the kernel serves kept pages as it serves the plain directory's), and on top of that
each request the caller waits for costs at least one bare round trip (every request but
`read`, `write`, `release` and `forget`: reads may overlap in read-ahead, a release and a
forget are not waited for) and each byte that crosses the channel at least two copies besides
the one the plain side makes too (a buffered `write`: the writer's buffer into the kernel's
pages, those pages into the daemon's buffer, and the daemon's `pwrite` is the plain side's
write; a `read` the daemon answers: its `pread` is the plain side's read, then its reply into
the kernel's pages, those pages into the reader's buffer). So floor time = plain time + files
x (waited requests x round trip, the request thread's at its own, its opens at an open
and close's extra time) + 2 x bytes crossed x
the time of one `memcpy` of them: a
lower bound on the mount's time, and an upper bound on its ratio. A figure whose floor misses
its target is out of reach at this round trip, whatever the daemon does; the rest of its gap
is the daemon's own work. O_DIRECT patterns get no floor: the plain side's I/O goes to the
disk, the daemon's to the backing file's page cache (`O_DIRECT` is not passed on).

The floor is a bound, not a daemon; beside the first mount the same patterns also go, in
the same repeats, through **the peer**: libfuse's own `passthrough_ll` in C, compiled from the
examples of the system's libfuse3-dev (`--no-peer` skips it; see kvfs.bench.door_peer). A
figure the peer misses too is out of reach for a FUSE daemon on this machine, in any language;
the distance between the peer and kvfs is kvfs's own. The peer takes no O_DIRECT pattern: it
passes O_DIRECT on to its backing files, whose writes refuse libfuse's unaligned buffers.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from . import door_peer
from .common import add_output_args, finish
from .door_io import CHUNK, aligned, direct_ok, read_files, write_files
from .door_record import draw, figure_rows, table
from .harness import (
    Mount,
    can_drop_caches,
    conditions,
    conditions_after,
    cpu_seconds,
    drop_caches,
    median,
)
from .records import Kind, figure_table

TENANT = "bench"
MiB = 1 << 20
#: pattern -> (file size in bytes, how many files at --scale 1).
PATTERNS: dict[str, tuple[int, int]] = {
    "small": (128 << 10, 2000), "file-2m": (2 * MiB, 64), "file-32m": (32 * MiB, 4),
    "file-256m": (256 * MiB, 1), "vllm": (2 * MiB, 64), "sglang": (2 * MiB, 64),
    "lmcache": (4 * MiB, 32), "lmcache-direct": (4 * MiB, 32), "file-chunked": (32 * MiB, 4),
}


#: Files every side has seen before the patterns run (`--aged`): more than the request
#: thread's table delegates (kvfs.daemon.passthrough MAX_DELEGATED), so that the patterns meet
#: the mount as a cache in use does, not as a fresh one.
AGED = 20000

METHOD = __doc__.split("\n\n", 1)[1] if __doc__ else ""


def add_arguments(parser: Any) -> None:
    parser.add_argument("--dir", default=".", help="where the work directory goes; its "
                        "filesystem is the one measured (default: here)")
    parser.add_argument("--patterns", default=",".join(PATTERNS),
                        help=f"comma-separated, of {', '.join(PATTERNS)} (default: all)")
    parser.add_argument("--files", type=int, default=None,
                        help="small files to create (default 2000 times --scale)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every pattern's file count (default 1: 128 MiB for "
                             "each engine pattern, 2000 small files)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; median (3)")
    parser.add_argument("--aged", type=int, default=AGED,
                        help=f"empty files created on the mount and the plain side before the "
                             f"patterns, as a cache that has seen that many files (default "
                             f"{AGED}: more than the mount's request thread keeps delegated; "
                             f"0: a fresh mount)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                        help="a mount with these extra `kvfs mount` arguments, measured in "
                             "the same run (repeatable; default: one mount, no extra "
                             "arguments, named 'default')")
    parser.add_argument("--round-trips", type=int, default=5000, dest="round_trips",
                        help="fstat calls timed for the bare FUSE round trip (5000; 0: none)")
    parser.add_argument("--no-cold", dest="cold", action="store_false",
                        help="skip cold reads (they need root, to drop the caches)")
    parser.add_argument("--no-peer", dest="peer", action="store_false",
                        help="skip the peer (libfuse's passthrough_ll in C, built from the "
                             "libfuse3-dev examples; measured beside the first mount where "
                             "it can be built)")
    parser.add_argument("--peer-options", dest="peer_options", default=door_peer.OPTIONS,
                        help=f"the peer's -o options ({door_peer.OPTIONS}; add ',writeback' "
                             "to compare with kvfs's --writeback-cache)")
    parser.add_argument("--note", default="", help="a note on the conditions, kept in the "
                        "record (say so when the machine is loaded by other work)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    add_output_args(parser)


# -- the mount side ---------------------------------------------------------------------------


class Side:
    """The mount side of a run: a :class:`kvfs.bench.harness.Mount` with one tenant, its
    daemon's counters: requests by kind, bytes through the mount, CPU time."""

    def __init__(self, base: str, extra: list[str]) -> None:
        self.mount = Mount.under(base, extra)
        self.root = ""
        self.pid = 0
        self.own: dict[str, int] = {}

    def start(self) -> None:
        self.mount.start()
        self.root = str(self.mount.add_tenant(TENANT))
        self.pid = self.mount.pid()
        # What reading the counters costs in requests itself (subtracted from every delta).
        a = self.counters()["requests"]
        self.own = {k: v - a.get(k, 0) for k, v in self.counters()["requests"].items()}

    def cpu_s(self) -> float:
        return cpu_seconds(self.pid)

    def counters(self) -> dict[str, Any]:
        """Requests by kind (stats.json `requests`; {} from a daemon that does not count
        them), bytes that crossed the FUSE channel (read and written through the mount, less
        what passthrough handles read and wrote), CPU seconds."""
        stats = self.mount.stats()
        moved = sum(f.get("read_bytes", 0) + f.get("write_bytes", 0)
                    for fps in (stats.get("tenants") or {}).values() for f in fps.values())
        pt = stats.get("passthrough") or {}
        moved -= pt.get("read_bytes", 0) + pt.get("write_bytes", 0)
        return {"requests": dict(stats.get("requests") or {}), "bytes": moved,
                "cpu_s": self.cpu_s()}

    def since(self, before: dict[str, Any]) -> dict[str, Any]:
        """What the daemon did since `before` (a :meth:`counters`): requests by kind (less
        what reading the counters costs), bytes through the channel, CPU seconds."""
        after = self.counters()
        req = {k: v - before["requests"].get(k, 0) - self.own.get(k, 0)
               for k, v in after["requests"].items()}
        return {"requests": {k: v for k, v in req.items() if v > 0},
                "bytes": after["bytes"] - before["bytes"],
                "cpu_s": after["cpu_s"] - before["cpu_s"]}


# -- the engines' file patterns -----------------------------------------------------------


def _timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _phase(res: dict[str, Any], mount: Any, what: str, fn: Callable[[], None]) -> None:
    """Time `fn` as `res[what_s]`; on a FUSE side (kvfs's or the peer's), what its daemon did
    for it too."""
    before = mount.counters() if mount is not None else None
    res[f"{what}_s"] = _timed(fn)
    if mount is not None and before is not None:
        res[f"{what}_daemon"] = mount.since(before)


def copy_seconds(size: int, n: int = 20) -> float:
    """The best time of one `memcpy` of `size` bytes between two buffers already touched: the
    least it costs to move a file's bytes across the FUSE channel once."""
    src = bytearray(os.urandom(min(size, MiB))) * max(1, size // MiB)
    dst = bytearray(len(src))
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        dst[:] = src
        best = min(best, time.perf_counter() - t)
    return best * size / len(src)


def copy_us(patterns: list[str]) -> dict[str, float]:
    """Microseconds of one `memcpy` of each pattern's file (:func:`copy_seconds`)."""
    return {p: round(copy_seconds(PATTERNS[p][0]) * 1e6, 2) for p in patterns}


def run_pattern(pattern: str, sides: dict[str, tuple[str, Any]], count: int,
                repeat: int, cold: bool) -> dict[str, dict[str, Any]]:
    """One repeat of one pattern on each side: seconds to write, to read warm and cold."""
    size = PATTERNS[pattern][0]
    buf = aligned(size)
    names = [f"{pattern}-{i:05d}.bin" for i in range(count)]
    direct = pattern in ("vllm", "lmcache-direct")
    chunk = CHUNK if pattern == "file-chunked" else 0
    out: dict[str, dict[str, Any]] = {}
    for side, (root, mount) in sides.items():
        if side == "peer" and direct:
            continue  # its backing O_DIRECT writes fail (EINVAL): libfuse's buffers unaligned
        d = os.path.join(root, f"{pattern}.{repeat}")
        os.makedirs(d)
        use_direct = direct and direct_ok(d)
        res: dict[str, Any] = {"direct": use_direct}
        os.sync()  # every side's writes start with nothing dirty (see the module's text)
        _phase(res, mount, "write",
               lambda d=d, o=use_direct: write_files(pattern, d, names, buf, o))
        _phase(res, mount, "warm", lambda d=d, o=use_direct: read_files(d, names, buf, o, chunk))
        if cold:
            drop_caches(3, daemon_pid=mount.pid if mount is not None else None)
            _phase(res, mount, "cold",
                   lambda d=d, o=use_direct: read_files(d, names, buf, o, chunk))
        out[side] = res
    if pattern != "small":  # (thousands of files: kept to the end, see the module's note)
        for side in out:
            shutil.rmtree(os.path.join(sides[side][0], f"{pattern}.{repeat}"))
    return out


def _best_us(call: Callable[[], object], n: int) -> float:
    """Microseconds of one `call`: the best of 5 batches of `n` / 5 (the floor must not be
    set by a pause), after a warm-up."""
    for _ in range(min(n, 200)):
        call()
    batches = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(max(1, n // 5)):
            call()
        batches.append((time.perf_counter() - t) / max(1, n // 5) * 1e6)
    return min(batches)


def _refused_xattr(fd: int) -> None:
    try:
        os.getxattr(fd, "security.kvfs-round-trip")
    except OSError:
        pass


def _open_close(path: str) -> None:
    os.close(os.open(path, os.O_RDONLY))


def _missing(path: str) -> None:
    try:
        os.stat(path)
    except FileNotFoundError:
        return
    raise AssertionError(f"{path} exists")


def round_trip(mount: Mount, plain: str, n: int, root: str = "") -> dict[str, float]:
    """Microseconds of one `fstat` through the mount on a file whose attributes the kernel
    may not cache (the daemon's `.kvfs/version`: a FUSE getattr answered with no work),
    against `fstat` of a plain file; where the mount's request thread runs, of a request it
    answers (`thread`: a `getxattr` outside `user.`, which the kernel does not cache), and of
    an open and close of a file it opens (`thread_open`, in the tenant directory `root`),
    against the same on the plain side (`plain_open`): OPEN is waited for, and the close
    wakes the thread for the RELEASE. And the `stat` of a name missing from a model
    directory (`miss`, a LOOKUP answered ENOENT; the second of a directory, whose first
    may hand it over to the request thread), against the plain side's (`plain_miss`)."""
    out = {}
    path = os.path.join(plain, "rt")
    with open(path, "w") as f:
        f.write("x")
    version = os.path.join(mount.mnt, ".kvfs", "version")
    for side, p in (("mount", version), ("plain", path)):
        fd = os.open(p, os.O_RDONLY)
        try:
            out[side] = _best_us(lambda fd=fd: os.fstat(fd), n)
        finally:
            os.close(fd)
    if root:
        model = os.path.join(root, "rt-model")
        os.mkdir(model)
        _missing(os.path.join(model, "missing"))
        out["miss"] = _best_us(lambda: _missing(os.path.join(model, "missing")), n)
        out["plain_miss"] = _best_us(lambda: _missing(os.path.join(plain, "missing")), n)
        os.rmdir(model)
    if root and (mount.stats().get("passthrough") or {}).get("request_thread"):
        fd = os.open(version, os.O_RDONLY)
        try:  # on the fd: a path would cost the lookups of its names too
            out["thread"] = _best_us(lambda: _refused_xattr(fd), n)
        finally:
            os.close(fd)
        mine = os.path.join(root, "rt")
        with open(mine, "w") as f:
            f.write("x")
        _open_close(mine)  # the daemon's open delegates it to the thread
        out["thread_open"] = _best_us(lambda: _open_close(mine), n)
        out["plain_open"] = _best_us(lambda: _open_close(path), n)
        os.unlink(mine)
    os.unlink(path)
    return out


# -- one mount variant ----------------------------------------------------------------------


def file_count(pattern: str, args: Any) -> int:
    """Files of `pattern`: --files for small files when given, else the default, scaled."""
    if pattern == "small" and args.files:
        return args.files
    return max(1, int(PATTERNS[pattern][1] * args.scale))


def age(directory: str, n: int) -> None:
    """Create `n` empty files in `directory` (`--aged`), each created and closed."""
    if n <= 0:
        return
    os.makedirs(directory)
    for i in range(n):
        os.close(os.open(os.path.join(directory, f"a{i:06d}"),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))


def run_variant(args: Any, work: str, name: str, extra: list[str], patterns: list[str],
                cold: bool, peer: tuple[str, str] | None = None) -> dict[str, Any]:
    """The patterns through a kvfs mount with `extra` arguments, a plain directory and, given
    its binary and options, the peer (:mod:`kvfs.bench.door_peer`), taking turns in each
    repeat."""
    base = os.path.join(work, name)
    side = Side(base, extra)
    peer_side = door_peer.PeerSide(base, *peer) if peer else None
    plain = os.path.join(base, "plain")
    os.makedirs(plain)
    side.start()
    try:
        if peer_side is not None:
            peer_side.start()
        # (Not the peer: it holds an fd for every inode the kernel knows, and an open-file
        # limit that cannot be raised would fail its creates.)
        for root in (side.root, plain):
            age(os.path.join(root, "aged"), args.aged)
        # The round trip and the copies before the patterns and after them, the faster of
        # the two: right after a burst of writes the kernel's write-back competes for the CPUs.
        first = (round_trip(side.mount, plain, args.round_trips, side.root)
                 if args.round_trips else {})
        copies = [copy_us(patterns)]
        sides: dict[str, tuple[str, Any]] = {"mount": (side.root, side),
                                             "plain": (plain, None)}
        if peer_side is not None:
            sides["peer"] = (peer_side.root, peer_side)
        results: dict[str, list[dict[str, dict[str, Any]]]] = {p: [] for p in patterns}
        for r in range(args.repeats):
            for p in patterns:
                count = file_count(p, args)
                # Alternate which side goes first, so that neither always meets the other's
                # writeback.
                order = dict(reversed(sides.items())) if r % 2 else sides
                results[p].append(run_pattern(p, order, count, r, cold))
        last = (round_trip(side.mount, plain, args.round_trips, side.root)
                if args.round_trips else {})
        rt = {k: min(first[k], last[k]) for k in last}
        copies.append(copy_us(patterns))
        stats = side.mount.stats()
        passthrough = stats.get("passthrough") or {}
        broken = side.mount.tracebacks() > 0
    finally:
        if peer_side is not None:
            peer_side.stop()
        side.mount.stop(check=False)
    return {"mount_args": extra, "patterns": summarise(results, args), "round_trip_us": rt,
            "passthrough": {k: passthrough.get(k) for k in ("state", "reason")},
            # The host's FUSE wake-ups during the run (kvfs.daemon.wakeup): a condition.
            "fuse_wake": stats.get("fuse_wake"),
            "copy_us": {p: min(c[p] for c in copies) for p in patterns},
            "daemon_tracebacks": broken}


def summarise(results: dict[str, list[dict[str, dict[str, Any]]]], args: Any
              ) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for p, runs in results.items():
        size = PATTERNS[p][0]
        count = file_count(p, args)
        s: dict[str, Any] = {"files": count, "file_kib": size >> 10,
                             "mib": round(size * count / MiB, 1),
                             "direct": {k: runs[0][k]["direct"] for k in ("mount", "plain")}}
        sides = [k for k in ("mount", "plain", "peer") if k in runs[0]]
        if "peer" in sides:
            s["peer_direct"] = runs[0]["peer"]["direct"]
        for side in sides:
            for what in ("write_s", "warm_s", "cold_s"):
                xs = [r[side][what] for r in runs if what in r[side]]
                if xs:
                    s[f"{side}_{what}"] = round(median(xs) or 0.0, 4)
        for what in ("write", "warm", "cold"):
            done = [r["mount"][f"{what}_daemon"] for r in runs if f"{what}_daemon" in r["mount"]]
            if not done:
                continue
            # Per file, medians of the repeats (requests: by kind).
            kinds = sorted({k for d in done for k in d["requests"]})
            s[f"{what}_per_file"] = {
                "requests": {k: x for k in kinds if (x := round((median(
                    [d["requests"].get(k, 0) for d in done]) or 0.0) / count, 2)) > 0},
                "bytes": round((median([d["bytes"] for d in done]) or 0.0) / count),
                "daemon_cpu_us": round((median([d["cpu_s"] for d in done]) or 0.0)
                                       / count * 1e6, 1)}
            peer = [r["peer"][f"{what}_daemon"] for r in runs if "peer" in r]
            if peer:
                s[f"peer_{what}_cpu_us"] = round(
                    (median([d["cpu_s"] for d in peer]) or 0.0) / count * 1e6, 1)
        for side, pre in (("mount", ""), ("peer", "peer_")):
            if f"{side}_write_s" not in s:
                continue
            s[f"{pre}creates_ratio"] = round(s[f"{side}_write_s"] / s["plain_write_s"], 3)
            for what in ("write", "warm", "cold"):
                if f"{side}_{what}_s" in s:
                    s[f"{pre}{what}_ratio"] = round(s[f"plain_{what}_s"] / s[f"{side}_{what}_s"],
                                                    3)
        out[p] = s
    return out


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    if not specs:
        return {"default": []}
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        if not sep or not name or name in out:
            raise ValueError(f"--variant {spec!r}: expected a new NAME=ARGS")
        out[name] = shlex.split(rest)
    return out


def run(args: Any) -> int:
    """`kvfs bench door` (its arguments checked by kvfs.cli.bench)."""
    variants = parse_variants(args.variant)
    patterns = [p for p in args.patterns.split(",") if p]
    cold = args.cold and can_drop_caches()
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".kvfs-bench-door-", dir=args.dir)
    started = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    peer: dict[str, Any] = {"name": door_peer.NAME, "options": args.peer_options,
                            "measured": False}
    try:
        cond = conditions({"work dir": work}, modules=("pyfuse3",), gpu=False)
        binary = None
        if args.peer:
            try:
                binary = door_peer.build(work)
                peer = {**peer, "measured": True, "why_not": None}
            except RuntimeError as exc:  # measured without it, and the record says why
                peer["why_not"] = str(exc)
                print(f"kvfs bench door: {exc}", file=sys.stderr)
        else:
            peer["why_not"] = "--no-peer"
        for name, extra in variants.items():
            results[name] = run_variant(args, work, name, extra, patterns, cold,
                                        binary and (binary, args.peer_options))
            binary = None  # beside the first mount only
        conditions_after(cond)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    rows = figure_rows(results)
    problems = [f"variant {n}: the daemon logged a traceback" for n, v in results.items()
                if v["daemon_tracebacks"]]
    record: dict[str, Any] = {
        "benchmark": "door", "rows": rows, "variants": results, "patterns": patterns,
        "peer": peer,
        "repeats": args.repeats, "scale": args.scale, "aged_files": args.aged,
        "cold_measured": cold,
        "seconds": round(time.monotonic() - started, 1), "problems": problems,
        "conditions": {**cond, "note": args.note},
    }
    return finish(record, args, table(rows), draw)


KIND = Kind("door", "Mount door", "kvfs bench door --out docs/bench", METHOD, figure_table,
            ("kvfs", "ratio"), shown=("variants", "patterns"), plot=draw)
