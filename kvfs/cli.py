"""`kvfs`: one program, one small function per subcommand.

Exit codes: 0 success; 1 the operation failed (the message says why); 2 bad usage or
configuration; 3 not a kvfs mount / not mounted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import stat
import subprocess
import sys
import time
from typing import Any

from . import __version__, control, settings
from .capacity import Budget
from .config import ConfigError
from .policy import DEFAULT_POLICY, POLICIES

log = logging.getLogger("kvfs")

EXIT_FAIL = 1
EXIT_USAGE = 2
EXIT_NOT_MOUNTED = 3


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAIL) -> None:
        super().__init__(message)
        self.code = code


def _private_log(path: str) -> None:
    """Create (or restrict) a daemon log as readable by its owner (root) alone: it names
    every tenant's files."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):  # (not a terminal or /dev/stderr)
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _setup_logging(log_file: str | None, debug: bool) -> None:
    handler: logging.Handler
    if log_file:
        _private_log(log_file)
        handler = logging.FileHandler(log_file)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        "%(asctime)s.%(msecs)03d %(process)d %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)


def _stats_path(mountpoint: str) -> str:
    return os.path.join(mountpoint, ".kvfs", "stats.json")


def read_stats(mountpoint: str) -> dict[str, Any]:
    if not os.path.ismount(mountpoint):
        raise CliError(f"{mountpoint} is not mounted", EXIT_NOT_MOUNTED)
    try:
        with open(_stats_path(mountpoint), "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        raise CliError(f"{mountpoint} is not a kvfs mount", EXIT_NOT_MOUNTED) from None
    except OSError as exc:
        raise CliError(f"cannot read {_stats_path(mountpoint)}: {exc.strerror}") from None


# -- mount / umount ------------------------------------------------------------------------


def cmd_mount(args: argparse.Namespace) -> int:
    from .mount import MountOptions  # noqa: PLC0415 - pyfuse3 only where needed

    values = settings.resolve(args, settings.load(args.config) if args.config else {})
    if not values["backing"] or not values["mountpoint"]:
        raise CliError("mount needs BACKING_DIR and MOUNTPOINT (or both in --config)", EXIT_USAGE)
    values["backing"] = os.path.abspath(values["backing"])
    values["mountpoint"] = os.path.abspath(values["mountpoint"])
    opts = MountOptions(**{s.name: values[s.name] for s in settings.SETTINGS if s.daemon})
    Budget(opts.capacity, opts.high_watermark, opts.low_watermark)  # the watermarks together
    if args.foreground:
        return _mount_foreground(opts, values["log"], args.ready_fd)
    # Background: run the daemon as a child in its own session, and return once it is ready.
    log_file = values["log"] = values["log"] or settings.default_log(opts.backing)
    if not os.path.isdir(opts.backing):
        raise CliError(f"backing directory {opts.backing} does not exist")
    if not os.path.isdir(opts.mountpoint):
        raise CliError(f"mount point {opts.mountpoint} is not a directory")
    os.makedirs(os.path.dirname(os.path.abspath(log_file)), mode=0o700, exist_ok=True)
    _private_log(log_file)
    rfd, wfd = os.pipe()
    cmd = [sys.executable, "-m", "kvfs.cli", "mount", *settings.daemon_argv(values),
           "--foreground", "--ready-fd", str(wfd)]
    with open(os.devnull, "rb") as devnull, open(log_file, "ab") as logf:
        proc = subprocess.Popen(cmd, stdin=devnull, stdout=logf, stderr=logf,
                                pass_fds=(wfd,), start_new_session=True)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as r:
        msg = r.read()
    if msg.startswith(b"ok"):
        print(f"kvfs: mounted {opts.mountpoint} (backing {opts.backing}, pid {proc.pid}, "
              f"log {log_file})")
        return 0
    code = proc.wait()
    raise CliError(msg.decode(errors="replace").strip() or
                   f"the daemon exited with status {code} before mounting; see {log_file}")


def _mount_foreground(opts: Any, log_file: str | None, ready_fd: int | None) -> int:
    from .mount import MountError, run  # noqa: PLC0415

    _setup_logging(log_file, opts.debug)

    def ready() -> None:
        if ready_fd is not None:
            os.write(ready_fd, b"ok\n")
            os.close(ready_fd)

    try:
        return run(opts, ready)
    except MountError as exc:
        log.error("%s", exc)
        if ready_fd is not None:
            os.write(ready_fd, f"{exc}\n".encode())
            os.close(ready_fd)
            return EXIT_FAIL
        raise CliError(str(exc)) from None


def cmd_umount(args: argparse.Namespace) -> int:
    mountpoint = os.path.abspath(args.mountpoint)
    pid = read_stats(mountpoint).get("pid")
    res = subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True, text=True)
    if res.returncode != 0:
        raise CliError(f"cannot unmount {mountpoint}: {res.stderr.strip()}")
    deadline = time.monotonic() + args.timeout
    while pid and _alive(pid):
        if time.monotonic() > deadline:
            raise CliError(f"unmounted, but the daemon (pid {pid}) has not exited after "
                           f"{args.timeout} s")
        time.sleep(0.05)
    print(f"kvfs: unmounted {mountpoint}")
    return 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except FileNotFoundError:
        return False


# -- status ----------------------------------------------------------------------------------


def human(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _hit_pct(c: dict[str, int]) -> str:
    hits = c["hit_blocks"] + c["mount_hits"]
    total = hits + c["miss_blocks"] + c["mount_misses"]
    return f"{100 * hits / total:.1f}" if total else "-"


def status_lines(stats: dict[str, Any]) -> list[str]:
    cap = stats.get("capacity_bytes")
    used = stats["used_bytes"]
    pct = f" ({100 * used / cap:.1f} %)" if cap else ""
    lines = [f"kvfs {stats['version']}  mount {stats['mountpoint']}  backing {stats['backing']}  "
             f"pid {stats['pid']}",
             f"hot: {human(used)} of {human(cap) if cap else 'the backing filesystem'}{pct}, "
             f"{stats['files']} files, {stats['open_files']} open"]
    left = stats.get("indexing", {}).get("directories_left", 0)
    if left:
        lines.append(f"indexing the backing tree: {stats['indexing']['entries_indexed']} "
                     f"entries so far, {left} directories left (usage counts what is indexed)")
    for t in stats.get("tiers", []):
        lines.append(f"{t['name']}: {t['url']}  holds {t['known_files']} blocks of this host "
                     f"({human(t['known_bytes'])})  circuit {t['circuit']}  hits {t['hits']}  "
                     f"misses {t['misses']}  timeouts {t['timeouts']}  errors {t['errors']}  "
                     f"uploads {t['uploads']} (failed {t['upload_failures']})")
    rows = [("TENANT", "NAMESPACE", "FILES", "BYTES", "HIT%", "HITS", "MISSES", "READ",
             "WRITTEN", "EVICTED")]
    for tenant, spaces in sorted(stats["tenants"].items()):
        for ns, c in sorted(spaces.items()):
            rows.append((tenant, ns or "-", str(c["files"]), human(c["bytes"]), _hit_pct(c),
                         str(c["hit_blocks"] + c["mount_hits"]),
                         str(c["miss_blocks"] + c["mount_misses"]),
                         human(c["read_bytes"] + c["direct_read_bytes"]),
                         human(c["write_bytes"] + c["published_bytes"]),
                         str(c["evictions"] + c["demotions"] + c["expirations"])))
    return lines + _table_lines(rows)


def cmd_status(args: argparse.Namespace) -> int:
    stats = read_stats(os.path.abspath(args.mountpoint))
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    print("\n".join(status_lines(stats)))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    """Refresh per-tenant hit rate, throughput and evictions per second."""
    mountpoint = os.path.abspath(args.mountpoint)
    prev, prev_t = read_stats(mountpoint), time.monotonic()
    shown = 0
    while args.count is None or shown < args.count:
        time.sleep(args.interval)
        cur, now = read_stats(mountpoint), time.monotonic()
        dt = max(now - prev_t, 1e-9)
        rows = [("TENANT", "NAMESPACE", "HIT%", "HIT%NOW", "READ/s", "WRITE/s", "EVICT/s",
                 "BYTES")]
        for tenant, spaces in sorted(cur["tenants"].items()):
            for ns, c in sorted(spaces.items()):
                p = prev["tenants"].get(tenant, {}).get(ns) or dict.fromkeys(c, 0)
                d = {k: c[k] - p.get(k, 0) for k in c}
                rows.append((tenant, ns or "-", _hit_pct(c), _hit_pct(d),
                             human((d["read_bytes"] + d["direct_read_bytes"]) / dt) + "/s",
                             human((d["write_bytes"] + d["published_bytes"]) / dt) + "/s",
                             f"{(d['evictions'] + d['demotions'] + d['expirations']) / dt:.1f}",
                             human(c["bytes"])))
        if sys.stdout.isatty():
            print("\033[H\033[2J", end="")
        print("\n".join(status_lines(cur)[:2] + _table_lines(rows)), flush=True)
        prev, prev_t = cur, now
        shown += 1
    return 0


def _table_lines(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _table(rows: list[tuple[str, ...]]) -> None:
    print("\n".join(_table_lines(rows)))


# -- tenants -----------------------------------------------------------------------------


def cmd_tenant_add(args: argparse.Namespace) -> int:
    mountpoint = os.path.abspath(args.mountpoint)
    read_stats(mountpoint)
    path = os.path.join(mountpoint, args.name)
    mode = int(args.mode, 8)
    try:
        os.mkdir(path, mode)
        os.chown(path, args.uid, args.gid)
        os.chmod(path, mode)
    except FileExistsError:
        raise CliError(f"tenant {args.name} already exists") from None
    except OSError as exc:
        raise CliError(f"cannot add tenant {args.name}: {exc.strerror}") from None
    print(f"kvfs: tenant {args.name} (uid {args.uid}, gid {args.gid}, mode {args.mode}) "
          f"at {path}")
    _set_limits(path, args)
    return 0


LIMIT_OPTIONS = (("quota", "quota"), ("max_idle", "max_idle"), ("max_age", "max_age"))


def _set_limits(path: str, args: argparse.Namespace) -> None:
    for attr, name in LIMIT_OPTIONS:
        value = getattr(args, attr, None)
        if value is None:
            continue
        try:
            os.setxattr(path, f"user.kvfs.{name}", value.encode())
        except OSError as exc:
            hint = " (only root sets limits)" if exc.errno == 1 else ""
            raise CliError(f"cannot set {name}={value} on {path}: {exc.strerror}{hint}") from None
        shown = os.getxattr(path, f"user.kvfs.{name}").decode()
        print(f"kvfs: {os.path.basename(path)}: {name} = {shown}")


def cmd_tenant_set(args: argparse.Namespace) -> int:
    mountpoint = os.path.abspath(args.mountpoint)
    read_stats(mountpoint)
    path = os.path.join(mountpoint, args.name)
    if not os.path.isdir(path):
        raise CliError(f"no tenant {args.name} in {mountpoint}")
    _set_limits(path, args)
    return 0


def cmd_tenant_list(args: argparse.Namespace) -> int:
    mountpoint = os.path.abspath(args.mountpoint)
    read_stats(mountpoint)
    rows = [("TENANT", "UID", "GID", "MODE", "USED", "QUOTA", "MAX_IDLE", "MAX_AGE")]
    for name in sorted(os.listdir(mountpoint)):
        if name == ".kvfs":
            continue
        path = os.path.join(mountpoint, name)
        st = os.stat(path)

        def x(attr: str, p: str = path) -> str:
            try:
                return os.getxattr(p, f"user.kvfs.{attr}").decode()
            except OSError:
                return "?"

        quota = x("quota")
        rows.append((name, str(st.st_uid), str(st.st_gid), f"{st.st_mode & 0o7777:o}",
                     human(int(x("used"))) if x("used").isdigit() else "?",
                     human(int(quota)) if quota.isdigit() else quota,
                     x("max_idle"), x("max_age")))
    _table(rows)
    return 0


def cmd_warm(args: argparse.Namespace) -> int:
    """Promote every block below PATH that lives in a lower tier (reading it through the
    mount fetches, verifies and places it hot), with progress."""
    todo = []
    for d, _, files in os.walk(args.path):
        for f in files:
            p = os.path.join(d, f)
            try:
                if os.getxattr(p, control.TIER) != b"hot":
                    todo.append(p)
            except OSError as exc:
                raise CliError(f"{p}: {exc.strerror} (is {args.path} in a kvfs mount?)") from None
    done = failed = 0
    start = time.monotonic()
    for p in todo:
        try:
            with open(p, "rb") as f:
                while f.read(1 << 20):
                    pass
            done += 1
        except OSError:
            failed += 1
        print(f"\rkvfs warm: {done + failed}/{len(todo)} blocks", end="", file=sys.stderr,
              flush=True)
    print("", file=sys.stderr)
    print(f"kvfs: warmed {done} blocks in {time.monotonic() - start:.1f} s"
          + (f", {failed} could not be fetched (misses)" if failed else ""))
    return EXIT_FAIL if failed else 0


def cmd_pin(args: argparse.Namespace) -> int:
    value = b"0" if args.unpin else b"1"
    count = 0
    for top in args.paths:
        paths = [top]
        if os.path.isdir(top):
            if not args.recursive:
                raise CliError(f"{top} is a directory (use -r)", EXIT_USAGE)
            paths = [os.path.join(d, f) for d, _, files in os.walk(top) for f in files]
        for path in paths:
            try:
                os.setxattr(path, control.PIN, value)
            except OSError as exc:
                raise CliError(f"cannot {'un' if args.unpin else ''}pin {path}: "
                               f"{exc.strerror}") from None
            count += 1
    print(f"kvfs: {'un' if args.unpin else ''}pinned {count} files")
    return 0


# -- fsck --------------------------------------------------------------------------------


def cmd_fsck(args: argparse.Namespace) -> int:
    from . import fsck  # noqa: PLC0415
    from .mount import MountError, open_index, open_state_dir  # noqa: PLC0415

    _setup_logging(None, args.debug)
    try:
        store, lock_fd = open_state_dir(os.path.abspath(args.backing))
    except MountError as exc:
        raise CliError(f"{exc}; unmount it first") from None
    index = open_index(store)

    def progress(n: int) -> None:
        print(f"\rfsck: {n} entries", end="", file=sys.stderr, flush=True)

    report = fsck.reconcile(index, store, verify=args.verify, progress=progress)
    print("", file=sys.stderr)
    index.set_meta("clean", "1")
    index.close()
    os.close(lock_fd)
    for label, items in (("added", report.added), ("dropped", report.dropped),
                         ("updated", report.updated), ("removed partial", report.removed_partial),
                         ("removed temporary", report.removed_temp),
                         ("quarantined", report.quarantined)):
        shown = items.examples[: args.show]
        for item in shown:
            print(f"{label}: {item}")
        if items.count > len(shown):
            print(f"{label}: ... and {items.count - len(shown)} more")
    print(f"fsck: {report.summary()}")
    return 0


# -- demo --------------------------------------------------------------------------------


def cmd_bench_report(args: argparse.Namespace) -> int:
    from .bench import report  # noqa: PLC0415

    try:
        count, missing = report.report(args.records, args.output, redraw=args.redraw)
    except report.ReportError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    print(f"{args.output}: {count} records from {args.records}"
          + (f"; not yet measured: {', '.join(missing)}" if missing else ""))
    return 0


def cmd_bench_restore(args: argparse.Namespace) -> int:
    import shutil  # noqa: PLC0415

    from .bench import restore  # noqa: PLC0415

    try:
        args.sizes = [int(x) for x in str(args.sizes).split(",") if x]
        args.threads = [int(x) for x in str(args.threads).split(",") if x]
    except ValueError:
        raise CliError("--sizes and --threads take comma-separated integers", EXIT_USAGE) from None
    if not args.sizes or not args.threads or min(args.sizes + args.threads) < 1:
        raise CliError("--sizes and --threads take positive integers", EXIT_USAGE)
    if args.paths is not None:
        args.paths = [p for p in str(args.paths).split(",") if p]
        unknown = sorted(set(args.paths) - set(restore.PATHS))
        if unknown or not args.paths:
            raise CliError(f"--paths: unknown {', '.join(unknown) or '(none given)'}; "
                           f"known: {', '.join(restore.PATHS)}", EXIT_USAGE)
    if (min(args.repeats, args.warm_repeats) < 1 or args.control_requests < 0
            or args.request_mib < 1
            or args.total_mib < max(args.sizes)):
        raise CliError("--repeats, --warm-repeats and --request-mib must be at least 1, "
                       "--control-requests not negative, --total-mib at least the largest "
                       "block size", EXIT_USAGE)
    if not os.path.isdir(args.dir):
        raise CliError(f"no directory {args.dir}", EXIT_USAGE)
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        raise CliError("kvfs bench restore mounts kvfs: it needs /dev/fuse and fusermount3",
                       EXIT_USAGE)
    return restore.main(args)


def cmd_bench_hitrate(args: argparse.Namespace) -> int:
    from .bench import hitrate  # noqa: PLC0415

    if args.trace not in ("agentic", "mixed") and not os.path.isfile(args.trace):
        raise CliError(f"no trace file {args.trace} (or use 'agentic' / 'mixed')", EXIT_USAGE)
    args.capacity_fraction = args.capacity_fraction or [0.1, 0.25, 0.5]
    for f in args.capacity_fraction:
        if not 0 < f <= 1:
            raise CliError(f"--capacity-fraction {f} is not in (0, 1]", EXIT_USAGE)
    if args.set and args.trace not in ("agentic", "mixed"):
        raise CliError("--set takes options of a generated trace, not of a file", EXIT_USAGE)
    if args.concurrency:
        if args.trace != "agentic":
            raise CliError("--concurrency needs the generated agentic trace (--trace agentic)",
                           EXIT_USAGE)
        if args.limit:
            raise CliError("--limit would cut each interleaving differently: set the number "
                           "of sessions instead (--set sessions=N)", EXIT_USAGE)
        if any(n < 1 for n in args.concurrency):
            raise CliError("--concurrency takes positive numbers of sessions", EXIT_USAGE)
    if args.limit is not None and args.limit < 1:
        raise CliError("--limit must be at least 1", EXIT_USAGE)
    from .trace import generator_options  # noqa: PLC0415

    try:
        args.options = (generator_options(args.trace, args.set)
                        if args.trace in ("agentic", "mixed") else {})
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    for name in ("seed", "concurrency"):
        if name in args.options:
            raise CliError(f"use --{name}, not --set {name}=...", EXIT_USAGE)
    try:
        return hitrate.main(args)
    except ValueError as exc:  # a trace or capacity the replay cannot use, said before mounting
        raise CliError(str(exc), EXIT_USAGE) from None


def cmd_bench_crossover(args: argparse.Namespace) -> int:
    from .bench import crossover  # noqa: PLC0415

    if any(n < 2 for n in args.lengths) or args.repeats < 1 or args.block_size < 1:
        raise CliError("lengths must be at least 2 tokens, repeats and block size at least 1",
                       EXIT_USAGE)
    try:
        args.config = crossover.model_config(args.model or [])
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    max_seq = args.config.get("max_seq", 16384)
    if max(args.lengths) >= max_seq:
        raise CliError(f"lengths must be under the model's max_seq ({max_seq})", EXIT_USAGE)
    return crossover.main(args)


def cmd_bench_engine(args: argparse.Namespace) -> int:
    import shutil  # noqa: PLC0415

    from .bench import engine  # noqa: PLC0415

    if not args.lengths or any(n < 2 for n in args.lengths):
        raise CliError("lengths must be at least 2 tokens", EXIT_USAGE)
    if max(args.lengths) + engine.TAIL + 1 > args.max_model_len:
        raise CliError(f"lengths must leave {engine.TAIL + 1} tokens under --max-model-len "
                       f"({args.max_model_len})", EXIT_USAGE)
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        raise CliError("kvfs bench engine mounts kvfs: it needs /dev/fuse and fusermount3",
                       EXIT_USAGE)
    return engine.main(args)


def cmd_bench_backends(args: argparse.Namespace) -> int:
    from .bench import backends  # noqa: PLC0415

    if args.total_mib < 4 or args.repeats < 1:
        raise CliError("--total-mib must be at least 4 and --repeats at least 1", EXIT_USAGE)
    return backends.run(args)


def cmd_bench_degraded(args: argparse.Namespace) -> int:
    from .bench import degraded  # noqa: PLC0415

    if args.requests < 1 or args.block_size < 1 or args.tokens < args.block_size:
        raise CliError("requests and block size must be at least 1, and tokens at least one "
                       "block", EXIT_USAGE)
    if not (args.fetch_timeout > 0 and args.tier_cooldown >= 0 and args.interval >= 0
            and args.slow_latency_ms >= 0 and args.slow_mbps >= 0):
        raise CliError("--fetch-timeout must be positive; cooldown, interval, latency and "
                       "bandwidth not negative", EXIT_USAGE)
    if not os.path.isdir(args.dir):
        raise CliError(f"no directory {args.dir}", EXIT_USAGE)
    if args.budget not in (None, "recompute"):
        try:
            args.budget = float(args.budget)
        except ValueError:
            args.budget = -1.0
        if args.budget < 0:
            raise CliError("--budget is 'recompute' or seconds (not negative)", EXIT_USAGE)
    if args.condition and "hot" in args.condition and "s3" not in args.condition:
        raise CliError("--condition hot repeats the s3 condition's requests: add "
                       "--condition s3", EXIT_USAGE)
    return degraded.main(args)


def cmd_bench_trace(args: argparse.Namespace) -> int:
    from . import trace  # noqa: PLC0415
    from .bench.common import conditions, finish  # noqa: PLC0415

    if (args.describe is None) == (args.output is None):
        raise CliError("give --output FILE (write a generated trace) or --describe FILE "
                       "(measure an existing one)", EXIT_USAGE)
    if args.block_tokens < 1:
        raise CliError("--block-tokens must be at least 1", EXIT_USAGE)
    if args.describe is not None:
        try:
            requests = trace.read_trace(args.describe)
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot read the trace: {exc}", EXIT_USAGE) from None
        params: dict = {"file": os.path.basename(args.describe)}
    else:
        items = list(args.set)
        for name, value in (("sessions", args.sessions), ("requests", args.requests),
                            ("concurrency", args.concurrency), ("seed", args.seed)):
            if value is not None:
                items.append(f"{name}={value}")
        try:
            params = trace.generator_options(args.kind, items)
            requests = trace.GENERATORS[args.kind](**params)
        except ValueError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
        if not requests:
            raise CliError("the generator made no requests", EXIT_USAGE)
        try:
            trace.write_trace(args.output, requests)
        except OSError as exc:
            raise CliError(f"cannot write {args.output}: {exc}", EXIT_USAGE) from None
        params = {"kind": args.kind, "file": os.path.basename(args.output), **params}
    figures = trace.describe(requests, block_tokens=args.block_tokens)
    record = {"benchmark": "trace", "trace": params, "block_tokens": args.block_tokens,
              **figures, "conditions": conditions([])}
    return finish(record, args, trace.format_description(figures))


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo  # noqa: PLC0415

    return run_demo(args.dir)


# -- main ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfs", description="kvfs: a KV-cache filesystem")
    p.add_argument("--version", action="version", version=f"kvfs {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("mount", help="mount kvfs over a backing directory")
    settings.add_arguments(m)
    m.add_argument("--foreground", "-f", action="store_true", help="stay attached")
    m.add_argument("--config", help="TOML config file; the command line overrides it")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.set_defaults(func=cmd_mount)

    u = sub.add_parser("umount", help="unmount and wait for the daemon to exit")
    u.add_argument("mountpoint")
    u.add_argument("--timeout", type=float, default=60.0)
    u.set_defaults(func=cmd_umount)

    s = sub.add_parser("status", help="usage, tenants and counters of a mount")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    tp = sub.add_parser("top", help="live per-tenant hit rate, throughput, evictions")
    tp.add_argument("mountpoint")
    tp.add_argument("--interval", type=float, default=1.0)
    tp.add_argument("--count", type=int, help="refreshes before exiting (default: forever)")
    tp.set_defaults(func=cmd_top)

    t = sub.add_parser("tenant", help="manage tenants")
    tsub = t.add_subparsers(dest="tenant_command", required=True)
    ta = tsub.add_parser("add", help="create a tenant directory owned by UID:GID")
    ta.add_argument("mountpoint")
    ta.add_argument("name")
    ta.add_argument("--uid", type=int, required=True)
    ta.add_argument("--gid", type=int, required=True)
    ta.add_argument("--mode", default="0700", help="octal mode (default 0700)")
    ta.set_defaults(func=cmd_tenant_add)
    ts = tsub.add_parser("set", help="set a tenant's quota and retention")
    ts.add_argument("mountpoint")
    ts.add_argument("name")
    ts.set_defaults(func=cmd_tenant_set)
    for parser in (ta, ts):
        parser.add_argument("--quota", help="bytes, e.g. 100G ('none' clears)")
        parser.add_argument("--max-idle", dest="max_idle",
                            help="remove files idle this long, e.g. 12h ('none' clears)")
        parser.add_argument("--max-age", dest="max_age",
                            help="remove files older than this, e.g. 7d ('none' clears)")
    tl = tsub.add_parser("list", help="list tenants")
    tl.add_argument("mountpoint")
    tl.set_defaults(func=cmd_tenant_list)

    w = sub.add_parser("warm", help="promote a namespace's blocks from the lower tiers")
    w.add_argument("path", help="a directory in the mount (a tenant or model namespace)")
    w.set_defaults(func=cmd_warm)

    for cmd, unpin in (("pin", False), ("unpin", True)):
        pp = sub.add_parser(cmd, help=f"{cmd} files: pinned files are never evicted or expired")
        pp.add_argument("paths", nargs="+")
        pp.add_argument("-r", "--recursive", action="store_true")
        pp.set_defaults(func=cmd_pin, unpin=unpin)

    f = sub.add_parser("fsck", help="reconcile an unmounted backing directory's index")
    f.add_argument("backing")
    f.add_argument("--verify", action="store_true", help="verify every block's checksum")
    f.add_argument("--show", type=int, default=20, help="changes to list per kind")
    f.add_argument("--debug", action="store_true")
    f.set_defaults(func=cmd_fsck)

    from .bench.common import add_output_args  # noqa: PLC0415 - stdlib only

    b = sub.add_parser("bench", help="benchmarks (ratios and conditions, JSON records)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    br = bsub.add_parser("restore", help="restore throughput and latency: direct path, mount, "
                         "raw preadv, fio, torch.load; control overhead")
    br.add_argument("--sizes", default="1,4,16,64", help="block sizes in MiB (1,4,16,64)")
    br.add_argument("--threads", default="1,2,4", help="I/O thread counts (1,2,4)")
    br.add_argument("--total-mib", type=int, default=256, dest="total_mib",
                    help="KV per block size, MiB (256)")
    br.add_argument("--request-mib", type=int, default=64, dest="request_mib",
                    help="KV restored per request, MiB: the latency unit (64)")
    br.add_argument("--repeats", type=int, default=3,
                    help="runs per figure with a cold page cache; median (3)")
    br.add_argument("--warm-repeats", type=int, default=7, dest="warm_repeats",
                    help="runs per figure with a warm page cache (short: more of them); "
                         "median (7)")
    br.add_argument("--control-requests", type=int, default=300, dest="control_requests",
                    help="64-block requests timed for the control overhead (300; 0: none)")
    br.add_argument("--no-cold", dest="cold", action="store_false",
                    help="skip the cold page-cache figures (they need root)")
    br.add_argument("--no-fio", dest="fio", action="store_false", help="skip fio")
    br.add_argument("--paths", default=None,
                    help="comma-separated paths to measure (default: all of raw, raw+xxh3, "
                         "fio, direct, direct-sampled, mount, torch.load; raw always, raw+xxh3 "
                         "with a direct path)")
    br.add_argument("--control-only", action="store_true", dest="control_only",
                    help="only the control-plane figures")
    br.add_argument("--quick", action="store_true", help="a smoke run: small, one repeat")
    br.add_argument("--keep", action="store_true", help="keep the work directory")
    br.add_argument("--dir", default=".", help="where the work directory goes; its "
                    "filesystem is the one measured (default: here)")
    from .bench.common import add_output_args as restore_output  # noqa: PLC0415

    restore_output(br)
    br.set_defaults(func=cmd_bench_restore)
    br = bsub.add_parser("report", help="render docs/benchmarks.md from the JSON records")
    br.add_argument("--records", default=os.path.join("docs", "bench"),
                    help="directory of the records and their plots (default: docs/bench)")
    br.add_argument("--output", default=os.path.join("docs", "benchmarks.md"),
                    help="the markdown file to write (default: docs/benchmarks.md)")
    br.add_argument("--redraw", action="store_true",
                    help="draw every record's PNG again from the record (needs matplotlib)")
    br.set_defaults(func=cmd_bench_report)
    bh = bsub.add_parser("hitrate", help="replay a request trace through a real mount")
    bh.add_argument("--trace", required=True,
                    help="a Mooncake-format JSONL file, or 'agentic' / 'mixed' (generated)")
    bh.add_argument("--capacity-fraction", type=float, action="append",
                    dest="capacity_fraction", help="hot capacity as a fraction of the trace's "
                    "distinct blocks (repeatable; default 0.1, 0.25, 0.5)")
    bh.add_argument("--policy", action="append", choices=POLICIES,
                    help=f"eviction policy (repeatable; default {DEFAULT_POLICY})")
    bh.add_argument("--block-kib", type=int, default=4, help="payload per block (scale)")
    bh.add_argument("--limit", type=int, help="replay only the first N requests")
    bh.add_argument("--seed", type=int, default=0, help="for generated traces")
    bh.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="an option of the generated trace (see kvfs.trace), e.g. "
                         "sessions=40; repeatable")
    bh.add_argument("--concurrency", type=int, action="append",
                    help="agentic trace: run its sessions N at a time (repeatable: one point "
                         "per N, the same sessions and capacity at each)")
    bh.add_argument("--dir", default=".", help="where to put the mounts (default: here)")
    add_output_args(bh)
    bh.set_defaults(func=cmd_bench_hitrate)

    bc = bsub.add_parser("crossover", help="time to first token: restore vs recompute")
    bc.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 512, 1024, 2048],
                    help="context lengths in tokens")
    bc.add_argument("--repeats", type=int, default=3)
    bc.add_argument("--cold", action="store_true", help="drop the page cache before restores")
    bc.add_argument("--model", action="append", metavar="FIELD=VALUE",
                    help="a larger demo model: any kvfs.tinylm.TinyLMConfig field, e.g. "
                         "num_layers=16 d_model=1024 (repeatable)")
    bc.add_argument("--block-size", type=int, default=16, dest="block_size",
                    help="tokens per KV block (16)")
    bc.add_argument("--dir", default=".", help="where to put the mount (default: here)")
    add_output_args(bc)
    bc.set_defaults(func=cmd_bench_crossover)
    bk = bsub.add_parser("backends", help="SGLang / LMCache: kvfs's storage backends against "
                         "each engine's own file backend (needs .venv-engines)")
    from .bench.backends import add_args as backends_args  # noqa: PLC0415 - stdlib only
    backends_args(bk)
    add_output_args(bk)
    bk.set_defaults(func=cmd_bench_backends)

    be = bsub.add_parser("engine", help="time to first token of a real vLLM: the "
                         "KVFSConnector against recompute and vLLM's ExampleConnector")
    be.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8000],
                    help="context lengths in tokens (256 1024 2048 4096 8000)")
    be.add_argument("--python", default=os.path.join(".venv-vllm", "bin", "python"),
                    help="the vLLM venv's interpreter (tools/setup_vllm.sh makes it)")
    be.add_argument("--model", default=os.path.join(".cache", "models",
                                                    "smollm2-135m-instruct"),
                    help="the model directory (tools/setup_vllm.sh converts SmolLM2-135M)")
    be.add_argument("--max-model-len", type=int, default=8192, dest="max_model_len")
    be.add_argument("--no-cold", dest="cold", action="store_false",
                    help="skip the cold page-cache condition (it needs root)")
    be.add_argument("--keep", action="store_true", help="keep the work directory")
    be.add_argument("--note", default="", help="a word on the conditions, kept in the record")
    be.add_argument("--dir", default=".", help="where to put the mount (default: here)")
    add_output_args(be)
    be.set_defaults(func=cmd_bench_engine)

    bd = bsub.add_parser("degraded", help="tail latency of loads on misses: no lower tier, "
                         "a slow one, a dead one")
    bd.add_argument("--budget", help="each lookup's budget for lower-tier fetches: seconds, or "
                    "'recompute' (the measured time to recompute the context); default: none, "
                    "each fetch is bounded by the fetch deadline only")
    bd.add_argument("--requests", type=int, default=30, help="requests per condition (30)")
    bd.add_argument("--tokens", type=int, default=2048, help="context length (2048)")
    bd.add_argument("--block-size", type=int, default=32, dest="block_size",
                    help="tokens per block (32)")
    bd.add_argument("--fetch-timeout", type=float, default=1.0, dest="fetch_timeout",
                    help="the mounts' fetch deadline, seconds (1)")
    bd.add_argument("--tier-cooldown", type=float, default=2.0, dest="tier_cooldown",
                    help="the mounts' circuit cooldown, seconds (2)")
    bd.add_argument("--interval", type=float, default=0.1,
                    help="pause between requests, seconds (0.1)")
    bd.add_argument("--slow-latency-ms", type=float, default=50.0, dest="slow_latency_ms",
                    help="the slow store's delay before each response (50)")
    bd.add_argument("--slow-mbps", type=float, default=50.0, dest="slow_mbps",
                    help="the slow store's pace per connection, MB/s (50; 0: unpaced)")
    bd.add_argument("--condition", action="append", choices=(
        "miss", "cold-dir", "cold-dir-uncached", "s3", "s3-slow", "dead-silent",
        "dead-refused", "hot"),
        help="run only these (repeatable; default all; 'hot' needs 's3')")
    bd.add_argument("--seed", type=int, default=0)
    bd.add_argument("--dir", default=".", help="where to put the mounts (default: here)")
    add_output_args(bd)
    bd.set_defaults(func=cmd_bench_degraded)

    bt = bsub.add_parser("trace", help="write a generated agentic or mixed trace (Mooncake "
                         "format) and measure it: shared prefix, reuse, concurrency, gaps")
    bt.add_argument("--kind", choices=("agentic", "mixed"), default="agentic")
    bt.add_argument("--output", help="the JSONL trace file to write")
    bt.add_argument("--describe", metavar="FILE",
                    help="measure this Mooncake-format trace instead of generating one")
    bt.add_argument("--sessions", type=int, help="agentic: sessions (default 300)")
    bt.add_argument("--concurrency", type=int,
                    help="agentic: run the sessions N at a time, closed-loop (default: "
                         "Poisson arrivals)")
    bt.add_argument("--requests", type=int, help="mixed: requests (default 4000)")
    bt.add_argument("--seed", type=int)
    bt.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="any other generator option (see kvfs.trace), e.g. turns=20")
    bt.add_argument("--block-tokens", type=int, default=512, dest="block_tokens",
                    help="tokens per block id, for measuring (default 512)")
    add_output_args(bt)
    bt.set_defaults(func=cmd_bench_trace)

    d = sub.add_parser("demo", help="mount a demo kvfs with real KV blocks in it")
    d.add_argument("dir", nargs="?", default="demo", help="where to put it (default ./demo)")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"kvfs: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CliError as exc:
        print(f"kvfs: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
