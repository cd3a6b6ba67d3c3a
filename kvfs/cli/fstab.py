"""`mount.fuse.kvfs`: the helper mount(8) runs for fstab lines and `mount -t fuse.kvfs`.

    /nvme/kvfs  /mnt/kvfs  fuse.kvfs  capacity=500G,shared=s3://kv/cache?region=x,_netdev  0 0

mount(8) calls ``mount.fuse.kvfs SOURCE MOUNTPOINT -o OPTIONS``; SOURCE is the backing
directory. Options are the long options of `kvfs mount` (underscores or dashes), ``key=value``
or bare flags; the generic mount options that mean nothing to kvfs (rw, defaults, auto,
noauto, user, nofail, _netdev, x-systemd.*, ...) are ignored. An unknown option is refused
with its name. Install: ``ln -s "$(command -v mount.fuse.kvfs)" /sbin/mount.fuse.kvfs``.
"""

from __future__ import annotations

import sys

from ..daemon.settings import fstab_options
from . import EXIT_USAGE
from . import main as kvfs_main

#: The options that take a value and the bare switches: `kvfs mount`'s (kvfs.daemon.settings).
VALUED, FLAGS = fstab_options()
IGNORED = {"rw", "ro", "defaults", "auto", "noauto", "user", "users", "nouser", "nofail",
           "_netdev", "exec", "noexec", "suid", "nosuid", "dev", "nodev", "atime", "noatime",
           "relatime", "async", "sync", "allow_other", "default_permissions"}


def translate(source: str, mountpoint: str, options: str) -> list[str]:
    """The `kvfs mount` command line for an fstab entry."""
    argv = ["mount", source, mountpoint]
    for opt in filter(None, options.split(",")):
        key, eq, value = opt.partition("=")
        name = key.replace("-", "_")
        if name in IGNORED or key.startswith(("x-", "comment")):
            continue
        if name in VALUED and eq:
            argv += [f"--{name.replace('_', '-')}", value]
        elif name in FLAGS and not eq:
            argv.append(f"--{name.replace('_', '-')}")
        else:
            raise ValueError(f"unknown kvfs mount option {opt!r}")
    return argv


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    positional, options = [], ""
    while args:
        a = args.pop(0)
        if a == "-o" and args:
            options = ",".join(filter(None, [options, args.pop(0)]))
        elif a.startswith("-o") and len(a) > 2:
            options = ",".join(filter(None, [options, a[2:]]))
        elif a in ("-n", "-s", "-f", "-v"):
            continue  # no mtab / sloppy / fake / verbose: nothing to do for kvfs
        else:
            positional.append(a)
    if len(positional) != 2:
        print("usage: mount.fuse.kvfs BACKING_DIR MOUNTPOINT [-o OPTIONS]", file=sys.stderr)
        return EXIT_USAGE
    try:
        cmd = translate(positional[0], positional[1], options)
    except ValueError as exc:
        print(f"mount.fuse.kvfs: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return kvfs_main(cmd)


if __name__ == "__main__":
    sys.exit(main())
