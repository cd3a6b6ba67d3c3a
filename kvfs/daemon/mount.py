"""The mount entry point: open the backing directory, mount, serve until unmounted.

This is the only module that imports `kvfs.daemon.fs` (and with it pyfuse3). It owns the daemon's
lifetime: the lock on the backing directory, the quick fsck after an unclean stop, the
pyfuse3 session, the trio nursery of background tasks, signal handling and the clean-stop
marker.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import resource
import signal
import sqlite3
from dataclasses import dataclass

import pyfuse3
import trio

from . import keys, made, scanner, wakeup, watchdog
from .audit import Audit
from .fs import MountInfo, Operations
from .index import Index
from .metrics import Metrics
from .notify import notify
from .promotion import MISS_WINDOW
from .settings import DEFAULTS
from .store import BackingStore
from .tiers import parse_shared, parse_tier_url
from .tiers.mover import Tiering
from .tiers.url import tier_dirs

#: The open-file limit the daemon raises its own to, where the hard limit allows.
FD_LIMIT = 1 << 20

log = logging.getLogger(__name__)

INDEX_NAME = "index.db"
LOCK_NAME = "lock"


class MountError(Exception):
    """A mount that cannot start, for a reason the user can fix."""


@dataclass
class MountOptions:
    """The daemon's settings; each is defined (type, default, check) in kvfs.daemon.settings."""

    backing: str
    mountpoint: str
    capacity: int | None = DEFAULTS["capacity"]
    debug: bool = DEFAULTS["debug"]
    io_threads: int = DEFAULTS["io_threads"]
    policy: str = DEFAULTS["policy"]
    high_watermark: float = DEFAULTS["high_watermark"]
    low_watermark: float = DEFAULTS["low_watermark"]
    scan_interval: float = DEFAULTS["scan_interval"]
    policy_entries: int = DEFAULTS["policy_entries"]
    cold: str | None = DEFAULTS["cold"]
    shared: str | None = DEFAULTS["shared"]
    write_through: bool = DEFAULTS["write_through"]
    fetch_timeout: float | None = DEFAULTS["fetch_timeout"]
    tier_cooldown: float = DEFAULTS["tier_cooldown"]
    tier_codec: str = DEFAULTS["tier_codec"]
    hot_codec: str = DEFAULTS["hot_codec"]
    metrics: str | None = DEFAULTS["metrics"]
    audit: str | None = DEFAULTS["audit"]
    writeback_cache: bool = DEFAULTS["writeback_cache"]
    keep_cache: bool = DEFAULTS["keep_cache"]
    passthrough: bool = DEFAULTS["passthrough"]
    thread_creates: bool = DEFAULTS["thread_creates"]
    wake_here: str = DEFAULTS["wake_here"]
    encrypt: bool = DEFAULTS["encrypt"]
    hot_encrypt: bool = DEFAULTS["hot_encrypt"]
    key_file: str = DEFAULTS["key_file"]
    key_command: str | None = DEFAULTS["key_command"]
    key_ttl: float = DEFAULTS["key_ttl"]
    read_ahead_kb: int = 4096  # the mount's read-ahead window (not a setting)


def open_state_dir(backing: str) -> tuple[BackingStore, int]:
    """Create the backing layout if needed and take the exclusive lock on it."""
    if not os.path.isdir(backing):
        raise MountError(f"backing directory {backing} does not exist")
    store = BackingStore(backing)
    os.makedirs(store.state_dir, mode=0o700, exist_ok=True)
    # The index, the log and the quarantine hold every tenant's names, sizes and hashes:
    # root's alone, also in a state directory an older version made world-readable.
    os.chmod(store.state_dir, 0o700)
    lock_fd = os.open(os.path.join(store.state_dir, LOCK_NAME.encode()),
                      os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.fchmod(lock_fd, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(lock_fd, 32, 0).decode(errors="replace").strip()
        os.close(lock_fd)
        raise MountError(
            f"backing directory {backing} is in use by another kvfs process (pid {holder})"
        ) from None
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
    return store, lock_fd


def open_index(store: BackingStore) -> Index:
    path = os.path.join(os.fsdecode(store.state_dir), INDEX_NAME)
    index = Index(path)
    for name in (path, path + "-wal", path + "-shm"):  # SQLite makes them 0644
        private(name)
    return index


def private(path: str) -> None:
    """Make a file of the daemon's readable and writable by its owner (root) alone."""
    try:
        os.chmod(path, 0o600)
    except FileNotFoundError:
        pass


def _tenants_gone(index: Index, store: BackingStore) -> bool:
    """Whether a tenant the index holds has no directory in the backing tree now (removed,
    or replaced by something else, while kvfs was not mounted)."""
    for t in index.tenants():
        try:
            os.close(store.opendir(t.name))
        except OSError as exc:
            log.warning("tenant %s: its backing directory cannot be opened (%s)",
                        t.name.decode(errors="replace"), exc.strerror)
            return True
    return False


def prepare(opts: MountOptions) -> tuple[Index, BackingStore, int]:
    """Lock the backing directory and bring the index up to date."""
    store, lock_fd = open_state_dir(opts.backing)
    store.clear_staging()  # fetches cut short by the last stop
    index = open_index(store)
    # What the request thread created and flushed since the last harvest, if the daemon
    # was killed in between: indexed as its harvest would have (kvfs.daemon.made).
    replayed = made.replay(index, store)
    if not index.has_entries():
        # A tree this index never saw (a first mount, an index deleted, files copied into a
        # backing directory whose index is empty): serve it at once, indexing a directory
        # when a request first names something in it, the rest in the background. The top
        # level (the tenants) is indexed now.
        report = scanner.adopt(index, store)
        log.info("adopting %s: %d tenants indexed, their directories indexed on demand and "
                 "in the background", opts.backing, report.added.count)
    elif index.get_meta("clean") != "1" or replayed or _tenants_gone(index, store):
        log.info("index of %s was not closed cleanly, or a tenant's directory is gone from "
                 "it: reconciling with the backing tree", opts.backing)
        report = scanner.reconcile(index, store, lazy=True,
                                progress=lambda n: log.info("fsck: %d entries", n))
        log.info("fsck: %s", report.summary())
    else:
        index.purge_orphans()
    index.set_meta("clean", "0")
    return index, store, lock_fd


async def widen_read_ahead(mountpoint: str, kb: int) -> None:
    """Widen the mount's read-ahead window (the kernel gives a FUSE mount 128 KiB): buffered
    reads then reach the daemon as many requests in flight instead of one at a time. The
    kernel sets the window when it initialises the connection, so this runs once serving has
    begun, and checks that it took."""
    for _ in range(10):
        await trio.sleep(0.1)
        if await trio.to_thread.run_sync(set_read_ahead, mountpoint, kb):
            return
    log.info("read-ahead of %s left as the kernel set it", mountpoint)


def set_read_ahead(mountpoint: str, kb: int) -> bool:
    """Set the read-ahead of the bdi behind `mountpoint` (found through /proc/self/mountinfo:
    a stat of the mount point would be a request to this very daemon); True if it holds."""
    fields = watchdog.mount_fields(mountpoint)
    try:
        if fields is None:
            return False
        path = f"/sys/class/bdi/{fields[2]}/read_ahead_kb"
        with open(path, "w") as f:
            f.write(str(kb))
        with open(path) as f:
            return int(f.read()) == kb
    except (OSError, ValueError) as exc:
        log.debug("read-ahead of %s: %s", mountpoint, exc)
        return False


def make_tiering(opts: MountOptions) -> Tiering | None:
    """The lower tiers, in order: the cold directory, then the shared ones (the object
    stores)."""
    tiers = []
    try:
        if opts.cold:
            tiers.append(parse_tier_url(opts.cold, "cold"))
        if opts.shared:
            tiers += parse_shared(opts.shared)
    except (ValueError, ImportError) as exc:
        raise MountError(str(exc)) from None
    if not tiers:
        return None
    return Tiering(tiers, trio.CapacityLimiter(32), write_through=opts.write_through,
                   fetch_timeout=opts.fetch_timeout, breaker_cooldown=opts.tier_cooldown,
                   encode=opts.tier_codec == "planes", hot_encoded=opts.hot_codec != "none",
                   hot_sealed=opts.hot_encrypt)


def _overlap(a: str, b: str) -> bool:
    """Whether directory `a` is `b` or inside it, or `b` inside `a` (both resolved)."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def check_places(opts: MountOptions, mountpoint: str) -> None:
    """Refuse a mount whose directories overlap, before anything is made: a backing
    directory (or a directory tier) that is the mount point, inside it, or holds it would be
    read by the daemon through its own mount, which waits on the daemon itself (a hang no
    signal ends); a directory tier that is or holds the backing directory, or is inside it,
    would mix its files with the hot tier's."""
    m, b = os.path.realpath(mountpoint), os.path.realpath(opts.backing)
    if _overlap(b, m):
        raise MountError(f"the backing directory {opts.backing} and the mount point "
                         f"{mountpoint} overlap (one is the other or inside it): the daemon "
                         "would read its own mount")
    try:
        dirs = tier_dirs(opts.cold, opts.shared)
    except ValueError as exc:
        raise MountError(str(exc)) from None
    for name, root in dirs:
        d = os.path.realpath(root)
        for what, where, path in (("mount point", mountpoint, m),
                                  ("backing directory", opts.backing, b)):
            if _overlap(d, path):
                raise MountError(f"the {name} tier's directory {root} and the {what} {where} "
                                 "overlap (one is the other or inside it)")


def make_keyring(opts: MountOptions, state_dir: str, tiering: Tiering | None
                 ) -> keys.Keyring | None:
    """The tenants' keys (kvfs.daemon.keys), where blocks are sealed: below the hot tier
    (unless ``--no-encrypt``) and, with ``--hot-encrypt``, in it; the wrapped keys' copies in
    ``state_dir/keys``."""
    if opts.hot_encrypt and not opts.encrypt:
        raise MountError("--hot-encrypt seals the hot tier, --no-encrypt turns sealing off: "
                         "choose one")
    if not opts.encrypt or (tiering is None and not opts.hot_encrypt):
        return None
    try:
        wrapper = keys.wrapper_from(opts.key_file, opts.key_command)
    except keys.KeyUnavailable as exc:
        raise MountError(f"{exc} (--no-encrypt stores blocks below the hot tier "
                         "unencrypted)") from None
    tiers = tiering.tiers if tiering is not None else []
    ring = keys.Keyring(wrapper, os.path.join(state_dir, "keys"), tiers, ttl=opts.key_ttl,
                        reach=tiering.reach if tiering is not None else None)
    if tiering is not None:
        tiering.keyring = ring
    return ring


def mount_options(debug: bool) -> set[str]:
    opts = set(pyfuse3.default_options)
    opts |= {"fsname=kvfs", "subtype=kvfs", "default_permissions"}
    if os.getuid() == 0:
        opts.add("allow_other")
    if debug:
        opts.add("debug")
    return opts


def raise_fd_limit() -> int:
    """The daemon holds an fd per open file and per directory handed to the request thread
    (kvfs.daemon.passthrough): the soft open-file limit raised to the hard one (at most
    FD_LIMIT), as its systemd unit sets it. The limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_LIMIT if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (OSError, ValueError) as exc:
            log.warning("could not raise the open-file limit from %d: %s", soft, exc)
    return soft


def run(opts: MountOptions, ready: callable | None = None) -> int:  # type: ignore[valid-type]
    """Mount and serve until unmounted or signalled. `ready()` is called once mounted."""
    os.umask(0)  # modes are set explicitly, as the callers asked for them
    fd_limit = raise_fd_limit()
    mountpoint = os.path.abspath(opts.mountpoint)
    if not os.path.isdir(mountpoint):
        raise MountError(f"mount point {mountpoint} is not a directory")
    if os.path.ismount(mountpoint):
        raise MountError(f"{mountpoint} is already a mount point")
    check_places(opts, mountpoint)
    try:
        audit = Audit(opts.audit) if opts.audit else None
    except OSError as exc:
        raise MountError(f"cannot open the audit log {opts.audit}: {exc.strerror}") from None
    tiering = make_tiering(opts)
    index, store, lock_fd = prepare(opts)
    info = MountInfo(mountpoint=mountpoint, backing=os.fsdecode(store.root),
                     capacity=opts.capacity, policy=opts.policy,
                     high_watermark=opts.high_watermark, low_watermark=opts.low_watermark,
                     scan_interval=opts.scan_interval, policy_entries=opts.policy_entries,
                     hot_codec=opts.hot_codec, hot_encrypt=opts.hot_encrypt)
    owner = os.stat(mountpoint).st_uid if os.getuid() != 0 else 0
    keyring = make_keyring(opts, os.fsdecode(store.state_dir), tiering)
    ops = Operations(index, store, info, owner_uid=owner, io_threads=opts.io_threads,
                     tiering=tiering, keyring=keyring, audit=audit,
                     writeback_cache=opts.writeback_cache,
                     keep_cache=opts.keep_cache, passthrough=opts.passthrough,
                     thread_creates=opts.thread_creates)
    ops.load_limits()
    metrics = None
    if opts.metrics:
        try:
            metrics = Metrics(opts.metrics, ops.snapshot)
            metrics.start()
        except (OSError, ValueError, ImportError) as exc:
            index.set_meta("clean", "1")
            index.close()
            raise MountError(f"cannot serve metrics on {opts.metrics}: {exc}") from None
    try:
        pyfuse3.init(ops, mountpoint, mount_options(opts.debug))
    except RuntimeError as exc:
        index.set_meta("clean", "1")
        index.close()
        raise MountError(f"cannot mount {mountpoint}: {exc}") from None
    log.info("mounted %s over %s (capacity %s)", mountpoint, opts.backing, opts.capacity)
    info.wake = wakeup.apply(opts.wake_here)  # the host's FUSE wake-ups (kvfs.daemon.wakeup)
    passthrough = ops.tree.passthrough
    passthrough.hook(os.fsdecode(store.root), writeback_cache=opts.writeback_cache,
                     miss_window=MISS_WINDOW, fd_limit=fd_limit)
    # Ends the mount if this process dies without unmounting (see kvfs.daemon.watchdog).
    watch_fd = watchdog.start(mountpoint)
    if ready is not None:
        ready()
    notify("READY=1")
    signalled = False

    async def main() -> None:
        nonlocal signalled
        async with trio.open_nursery() as nursery:

            async def watch_signals() -> None:
                nonlocal signalled
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
                    async for signum in sigs:
                        log.info("signal %d: unmounting", signum)
                        signalled = True
                        pyfuse3.terminate()
                        return

            nursery.start_soon(watch_signals)
            # Once the kernel's INIT is answered: is passthrough on? (said in the log)
            nursery.start_soon(passthrough.probe, os.path.join(
                os.fsdecode(store.state_dir), LOCK_NAME))
            await ops.settle()  # requests wait in the kernel meanwhile
            nursery.start_soon(widen_read_ahead, mountpoint, opts.read_ahead_kb)
            nursery.start_soon(ops.run_background)
            if metrics is not None:
                nursery.start_soon(metrics.run)
            if audit is not None:
                nursery.start_soon(audit.run)
            await pyfuse3.main(min_tasks=4, max_tasks=64)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        notify("STOPPING=1")
        try:
            pyfuse3.close(unmount=signalled)
        except OSError as exc:  # already unmounted by fusermount3 -u
            if exc.errno not in (errno.EINVAL, errno.ENOENT):
                raise
        finally:
            ops.tree.collect_opens()  # the request thread's last opens: their access times
            passthrough.unhook()
        watchdog.clean_stop(watch_fd)
        try:
            for of_inode in list(ops.open_files):
                ops._persist(of_inode)  # noqa: SLF001 - files open when the kernel went away
            ops.flush_atimes()
            index.set_meta("clean", "1" if not ops.open_files else "0")
        except sqlite3.Error as exc:  # (a full disk): the next mount checks the index whole
            log.warning("the index could not be marked clean (%s): the next mount checks it "
                        "against the backing directory", exc)
        index.close()
        if tiering is not None:
            tiering.close()
        if audit is not None:
            audit.close()
        os.close(lock_fd)
        log.info("unmounted %s", mountpoint)
    return 0
